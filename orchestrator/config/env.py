"""``env``: multi-turn episodes (environments, tools, limits) as config data; plugins named here are loaded
when the config is, so a wrong one is a config error before any actor starts. The behaviour lives in
:mod:`workers.envs`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.config.section import Section


class EnvConfig(Section):
    """Multi-turn episodes (agentic RL): with `name` set, each of a prompt's G samples is an episode of an
    environment instead of one completion (see docs/agents.md)."""

    name: str | None = None
    """None: single-turn (one prompt -> one completion). `tool`: the stock tool environment (the model calls the
    `tools`, each result is appended as an observation; a turn without a tool call ends the episode), or a
    registered environment name, or `package.module:Class` of your own `workers.envs.Environment`."""
    tools: list[str] = Field(default_factory=lambda: ["calculator"])
    """Tools of the `tool` environment: `calculator` (arithmetic, an AST whitelist), `python` (runs code in the
    namespace sandbox, `rewards/sandbox.py`), or `package.module:tool` (a `workers.envs.Tool`)."""
    renderer: Literal["auto", "text", "chat"] = "auto"
    """How messages become tokens. `chat`: the tokenizer's chat template (hermes `<tool_call>` JSON; a template
    that re-renders earlier turns is refused); `text`: plain text with delimiters (`[call]` / `{result}`, the
    embedded calculator model); `auto`: `chat` when the tokenizer has a chat template."""
    max_turns: int = Field(4, ge=1, le=1000)
    """Assistant turns per episode; an episode still going after them ends with reason `max_turns`."""
    max_tool_calls: int = Field(4, ge=0, le=1000)
    """Tool calls per episode; past it the episode ends with reason `max_tool_calls`."""
    max_total_tokens: int = Field(64, ge=8, le=1_048_576)
    """Token budget of an episode: prompt + every turn + every observation (also the engines' context length).
    A turn is cut to what is left; an observation that would overflow ends the episode (`max_total_tokens`)."""
    episode_timeout_s: float = Field(60.0, gt=0.0)
    """Time the environment may spend in one episode: `reset`, every `step` and the tools they run, summed; the
    engine's turns (queued behind every other episode) do not count. Past it the episode ends with reason
    `timeout` and counts as errored."""
    tool_timeout_s: float = Field(5.0, gt=0.0)
    """Per tool call: a call running longer becomes an error observation; the episode goes on."""
    max_tool_output_chars: int = Field(2000, ge=16)
    """A tool's output is cut to this many characters (marked as cut)."""
    errored: Literal["drop_group", "keep"] = "drop_group"
    """Episodes that errored (the environment raised, or the episode timed out): `drop_group` gives their whole
    group zero loss and leaves it out of the reward statistics (no biased baseline); `keep` scores them as they
    are."""
    agent: str | None = None
    """`package.module:function`: agent code written against the `openai` client, as the environment. An `async
    def fn(client, task) -> reward` (a number or a dict of numbers, summed) run G times per prompt, each run one
    session of the rollout actor's OpenAI-compatible endpoint (`client` is an `openai.AsyncOpenAI` pointed at it);
    the tokens its calls sampled are the sample. Replaces `name`. `external`: the agents run outside the fleet
    and claim, call and finish their sessions through the endpoints listed in `<run.dir>/agent_endpoints.json`
    (see docs/agents.md)."""
    endpoint_host: str = "127.0.0.1"
    """Address the agent endpoint binds (loopback: only processes on the rollout actor's node reach it; `0.0.0.0`
    for external agents on other machines, the endpoint then advertised at the node's IP)."""
    args: dict = Field(default_factory=dict)
    """Keyword arguments for the environment's constructor."""
    num_workers: int = Field(0, ge=0, le=1024)
    """0: environments run inside the rollout actors. N > 0: in N `env-i` Ray actors of their own (heavy
    environments), which `fleetrl scale --env N` resizes between steps."""
    num_cpus: float = Field(0.25, ge=0.0)
    """Ray CPUs reserved by each `env-i` actor."""

    @field_validator("name")
    @classmethod
    def _check_environment(cls, name: str | None) -> str | None:
        """A plugin that is not what it claims is a config error here, before any actor starts."""
        if name is not None:
            from workers.envs.api import load_environment

            _load_plugin(load_environment, name)
        return name

    @field_validator("agent")
    @classmethod
    def _check_agent(cls, spec: str | None) -> str | None:
        if spec is not None:
            from workers.envs.agent import load_agent

            _load_plugin(load_agent, spec)
        return spec

    @model_validator(mode="after")
    def _agent_replaces_name(self) -> EnvConfig:
        if self.agent and self.name:
            raise ValueError(f"env.agent={self.agent} is the environment: env.name={self.name} must be unset")
        if self.agent and self.num_workers:
            raise ValueError(f"env.agent runs inside the rollout actors, beside their endpoint: env.num_workers="
                             f"{self.num_workers} must be 0")
        if self.agent and self.renderer == "text":
            raise ValueError("env.agent talks to the model through the chat template: env.renderer must be chat or "
                             "auto, not text")
        return self

    @property
    def multi_turn(self) -> bool:
        """Each sample is an episode (an environment's or an agent's), not one completion."""
        return bool(self.name or self.agent)

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, tools: list[str]) -> list[str]:
        from workers.envs.tools import load_tool

        for spec in tools:
            _load_plugin(load_tool, spec)
        return tools


def _load_plugin(loader, spec: str) -> None:
    """``loader(spec)``, any failure of it (unknown name, a module that does not import or raises on import, an
    object of the wrong kind) as a ValueError with one line saying why."""
    import workers.envs  # noqa: F401  (registers the stock environments and tools)

    try:
        loader(spec)
    except (KeyError, ValueError) as e:
        raise ValueError(str(e.args[0]) if e.args else repr(e)) from None
    except Exception as e:  # noqa: BLE001 - a plugin module that fails on import: its error, in one line
        raise ValueError(f"{spec!r} cannot be imported: {type(e).__name__}: {e}") from None
