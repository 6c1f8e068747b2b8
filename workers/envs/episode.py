"""One multi-turn episode as an asyncio coroutine, engine-agnostic: :func:`run_episode`.

The token contract (what the learner trains on):

- ``token_ids``: the rendered initial messages, then for every turn the ids the engine sampled (verbatim, the
  stop / EOS token included), then the ids the renderer appends after the turn (observations and template glue).
  Sampled text is never decoded and re-encoded into the context.
- ``mask``: 1 exactly on sampled ids, 0 on the prompt, observations, glue and anything else the framework adds.
- ``logprobs``: the engine's logprob of each sampled id, 0.0 elsewhere. All three have the same length.
- ``turn_ends``: index of each turn's last sampled id; ``turn_rewards``: the environment's reward per turn.

Limits (:class:`EpisodeLimits`) end an episode cleanly with a recorded ``termination``: ``done`` (the environment
said so), ``max_turns``, ``max_tool_calls``, ``max_total_tokens`` (a turn is cut to the budget left; an
observation that would overflow it is not appended), ``truncated`` (a turn hit the per-turn cap unfinished),
``timeout`` (the environment's own time, see :class:`EnvClock`) or ``env_error`` (the environment raised).
``close()`` is called once in every case.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from workers.envs.api import Action, Environment, call
from workers.envs.renderers import Renderer


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_tool_calls: int = 4
    max_total_tokens: int = 1024
    max_new_tokens: int = 64  # per turn
    episode_timeout_s: float = 60.0  # the environment's time (reset, steps, tools), see EnvClock


class EnvClock:
    """The time an episode's environment may spend: ``reset``, every ``step`` and the tools they call, summed.
    The engine's turns do not count: they wait behind every other episode the engine serves (100 greedy eval
    episodes on one 2-core engine take a minute each), so a wall-clock limit would cut healthy episodes under
    load while it is there for a hanging environment. Past the limit the pending call is cancelled
    (``TimeoutError``)."""

    def __init__(self, limit_s: float):
        self.left = limit_s

    async def run(self, awaitable):
        t0 = time.perf_counter()
        try:
            return await asyncio.wait_for(awaitable, max(self.left, 0.0))
        finally:
            self.left -= time.perf_counter() - t0


ERRORED = ("timeout", "env_error")
"""Terminations of an episode that failed (its group is dropped by default, ``env.errored``)."""
LIMITED = ("max_turns", "max_tool_calls", "max_total_tokens", "truncated")
"""Terminations of an episode cut by a limit (``env/truncated_frac``)."""


@dataclass
class Episode:
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    termination: str = ""
    tool_calls: int = 0
    tool_errors: int = 0
    tools_called: list[str] = field(default_factory=list)  # the name of each call, in order
    tool_seconds: list[float] = field(default_factory=list)
    observation_tokens: int = 0
    finish_reason: str = "stop"  # of the last turn

    @property
    def errored(self) -> bool:
        return self.termination in ERRORED

    def append(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        """Sampled ids (with their logprobs: trained) or framework ids (without: mask 0)."""
        self.token_ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


async def run_episode(env: Environment, renderer: Renderer, task: dict, seed: int, limits: EpisodeLimits,
                      generate) -> Episode:
    """``generate(context_ids, max_new_tokens)`` -> awaitable completion (``token_ids``, ``logprobs``, ``text``,
    ``finish_reason``), supplied by the caller (the rollout actor backs it with vLLM)."""
    ep = Episode()
    try:
        await _play(env, renderer, task, seed, limits, generate, ep, EnvClock(limits.episode_timeout_s))
    except TimeoutError:
        ep.termination = "timeout"
    except Exception as e:  # the environment's (or renderer's) failure ends this episode only
        ep.termination, ep.info["error"] = "env_error", f"{type(e).__name__}: {e}"[:500]
    finally:
        try:
            await call(env.close, timeout_s=10.0)
        except Exception as e:
            ep.info["close_error"] = f"{type(e).__name__}: {e}"[:200]
    return ep


async def _play(env, renderer: Renderer, task: dict, seed: int, limits: EpisodeLimits, generate, ep: Episode,
                clock: EnvClock):
    ep.messages = renderer.conversation(await clock.run(call(env.reset, task, seed)))
    ep.append(renderer.initial(ep.messages))
    ep.prompt_len = len(ep.token_ids)
    for _ in range(limits.max_turns):
        budget = limits.max_total_tokens - len(ep.token_ids)
        if budget <= 0:
            ep.termination = "max_total_tokens"
            return
        turn = await generate(list(ep.token_ids), min(limits.max_new_tokens, budget))
        ep.append(list(turn.token_ids), list(turn.logprobs))
        ep.turn_ends.append(len(ep.token_ids) - 1)
        ep.turn_texts.append(turn.text)
        ep.finish_reason = turn.finish_reason
        calls = renderer.tool_calls(turn.text)
        ep.messages.append({"role": "assistant", "content": turn.text})
        if ep.tool_calls + len(calls) > limits.max_tool_calls:
            ep.turn_rewards.append(0.0)
            ep.termination = "max_tool_calls"
            return
        result = await clock.run(call(env.step, Action(list(turn.token_ids), turn.text, turn.finish_reason, calls)))
        _count_tools(ep, calls, result.info)
        reward = float(result.reward)
        if not math.isfinite(reward):  # ends the episode as env_error: its group is dropped, nothing trains on it
            raise ValueError(f"the environment's step returned reward={reward}: a turn's reward must be finite")
        ep.turn_rewards.append(reward)
        if turn.finish_reason == "length":  # a turn cut unfinished ends the episode, and says so
            ep.termination = "max_total_tokens" if budget <= limits.max_new_tokens else "truncated"
            return
        if result.done:
            ep.termination = "done"
            return
        appended = renderer.after_turn(ep.messages, list(turn.token_ids), result.observation)
        if len(ep.token_ids) + len(appended) >= limits.max_total_tokens:
            ep.termination = "max_total_tokens"
            return
        ep.append(appended)
        ep.observation_tokens += len(appended)
        ep.messages += result.observation
    ep.termination = "max_turns"


def _count_tools(ep: Episode, calls: list, info: dict) -> None:
    ep.tool_calls += len(calls)
    for record in info.pop("tool_calls", []):
        ep.tool_seconds.append(record["seconds"])
        ep.tools_called.append(record["name"])
        ep.tool_errors += record["error"] is not None
    ep.info.update(info)
