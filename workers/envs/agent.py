"""Agent functions as the environment (``env.agent: package.module:function``): the agent code a user already has,
written against the ``openai`` client, run G times per task; each run is one session of the rollout actor's
endpoint (:mod:`workers.envs.endpoint`) and one sample.

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float:
        reply = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...
        return reward

``task`` is the task row (the prompt's metadata plus ``prompt``), as an environment's ``reset`` gets it. The
return value is the run's reward, placed on its last turn (added to ``reward.functions``' score of the last
reply); a dict of numbers is summed. A run that raises, returns no number or made no call ends as ``env_error``,
one past ``env.episode_timeout_s`` (wall time, the model's turns included) as ``timeout``: both count as errored
(``env.errored``: the group dropped by default), never a crashed step.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import itertools
import numbers

from workers.envs.endpoint import Endpoint
from workers.envs.episode import Episode
from workers.envs.sessions import SessionLimits


def load_agent(spec: str):
    """``package.module:function``, an ``async def`` of two parameters (client, task)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"env.agent {spec!r}: give it as package.module:function")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        raise ValueError(f"env.agent {spec!r}: module {e.name!r} not found") from None
    except AttributeError:
        raise ValueError(f"env.agent {spec!r}: {module} has no {attr!r}") from None
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"env.agent {spec!r} is not an async function (async def {attr}(client, task))")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ValueError(f"env.agent {spec!r} must take two arguments: (client, task)") from None
    return fn


def reward_of(value, spec: str) -> float:
    """An agent's return value as a reward: a number, or a dict of numbers (summed)."""
    parts = value.values() if isinstance(value, dict) else [value]
    if not parts or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in parts):
        raise TypeError(f"env.agent {spec} returned {value!r}: a number or a dict of numbers is expected")
    return float(sum(parts))


class AgentRunner:
    """A rollout actor's agent episodes: the endpoint (served while :meth:`serving`), one session per run."""

    def __init__(self, env: dict, tokenizer, max_new_tokens: int, sampling: dict, name: str = ""):
        self.spec, self.fn = env["agent"], load_agent(env["agent"])
        self.timeout_s = env["episode_timeout_s"]
        self.endpoint = Endpoint(tokenizer, "policy", SessionLimits(env["max_turns"], env["max_total_tokens"],
                                                                    max_new_tokens),
                                 sampling, env.get("system_prompt"), env.get("endpoint_host", "127.0.0.1"))
        self.ids = itertools.count()
        self.name = name

    @contextlib.asynccontextmanager
    async def serving(self):
        await self.endpoint.start()
        try:
            yield
        finally:
            await self.endpoint.stop()

    def episode(self, prompt, metadata: dict, version, turn_seed):
        """A callable ``generate -> coroutine`` (:func:`workers.engine_loop.run_all`) running the agent once."""
        task = {**metadata, "prompt": prompt}
        sid = f"{self.name or 'agent'}-{next(self.ids)}"

        def start(generate):
            calls = itertools.count()

            async def gen(ids, max_new_tokens, stop):
                return await generate(ids, max_new_tokens, turn_seed(next(calls)), stop)

            return self._run(sid, task, gen, version)

        return start

    async def _run(self, sid: str, task: dict, generate, version) -> Episode:
        import openai

        session = self.endpoint.open(sid, generate, version)
        client = openai.AsyncOpenAI(base_url=self.endpoint.url(sid), api_key=self.endpoint.token, max_retries=2,
                                    http_client=openai.DefaultAsyncHttpxClient(trust_env=False))
        termination, error, reward = "done", None, 0.0
        try:
            reward = reward_of(await asyncio.wait_for(self.fn(client, task), self.timeout_s), self.spec)
        except TimeoutError:
            termination = "timeout"
        except Exception as e:  # the agent's failure ends its own run only
            termination, error = "env_error", f"{type(e).__name__}: {e}"[:500]
        finally:
            await client.close()
            self.endpoint.close(sid)
        ep = session.episode()
        if not ep.turn_ends:  # no call answered: the sample is the task's prompt alone (its group is errored)
            if termination == "done":
                termination, error = "env_error", f"env.agent {self.spec} returned without calling the model"
            if not ep.token_ids:
                prompt = task["prompt"]
                ep.append(session.renderer.initial(session.renderer.conversation(
                    [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt))))
                ep.prompt_len = len(ep.token_ids)
        if termination == "done" and ep.finish_reason == "length":
            termination = "truncated"
        if ep.turn_rewards and termination in ("done", "truncated"):
            ep.turn_rewards[-1] += reward
        ep.termination = termination
        ep.info["agent/calls"] = session.calls
        if error:
            ep.info["error"] = error
        return ep
