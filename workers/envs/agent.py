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

``env.agent: external``: the agents run outside the fleet (another process or machine). Each run is offered on
the endpoint's control side (:mod:`workers.envs.endpoint`): an agent claims it (``POST /v1/sessions``), calls the
model at the ``base_url`` it gets, and finishes it with its reward (``POST /sessions/{id}/finish``). A run nobody
claims or finishes within ``env.episode_timeout_s`` ends as ``timeout`` (``agent/unclaimed`` counts those never
claimed). Chat, reward and finish on a session nobody claimed are refused (409), and session ids are random. The
driver writes every rollout actor's address and token to ``<run.dir>/agent_endpoints.json`` (mode 0600, removed
when the run ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import itertools
import secrets

from common.net import free_port
from workers.envs.endpoint import Endpoint, reward_of
from workers.envs.episode import Episode
from workers.envs.sessions import SessionLimits

EXTERNAL = "external"
"""``env.agent`` for agents that run outside the fleet and drive their sessions through the control endpoints."""


def load_agent(spec: str):
    """``package.module:function``, an ``async def`` of two parameters (client, task); None for ``external``."""
    if spec == EXTERNAL:
        return None
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


class AgentRunner:
    """A rollout actor's agent episodes: the endpoint (served while :meth:`serving`), one session per run."""

    def __init__(self, env: dict, tokenizer, max_new_tokens: int, sampling: dict, name: str = ""):
        self.spec, self.fn = env["agent"], load_agent(env["agent"])
        self.timeout_s = env["episode_timeout_s"]
        host = env.get("endpoint_host", "127.0.0.1")
        port = free_port(host) if self.fn is None else 0  # external agents keep one address across calls
        self.endpoint = Endpoint(tokenizer, "policy", SessionLimits(env["max_turns"], env["max_total_tokens"],
                                                                    max_new_tokens),
                                 sampling, env.get("system_prompt"), host, port)
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
        # an external session's id is random: an agent that claimed one cannot guess (and spoil) the others
        sid = f"{self.name or 'agent'}-{next(self.ids) if self.fn else secrets.token_urlsafe(12)}"

        def start(generate):
            calls = itertools.count()

            async def gen(ids, max_new_tokens, stop):
                return await generate(ids, max_new_tokens, turn_seed(next(calls)), stop)

            return self._run(sid, task, gen, version)

        return start

    async def _run(self, sid: str, task: dict, generate, version) -> Episode:
        run = self._external if self.fn is None else self._in_process
        session, (termination, error, reward) = await run(sid, task, generate, version)
        return self._finish(session, task, termination, error, reward)

    async def _in_process(self, sid: str, task: dict, generate, version):
        import openai

        session = self.endpoint.open(sid, generate, version)
        client = openai.AsyncOpenAI(base_url=self.endpoint.url(sid), api_key=self.endpoint.token, max_retries=2,
                                    http_client=openai.DefaultAsyncHttpxClient(trust_env=False))
        try:
            return session, await self._outcome(asyncio.wait_for(self.fn(client, task), self.timeout_s))
        finally:
            await client.close()
            self.endpoint.close(sid)

    async def _external(self, sid: str, task: dict, generate, version):
        session, offer = self.endpoint.offer(sid, task, generate, version)

        async def finished():
            reward = await asyncio.wait_for(asyncio.shield(offer.done), self.timeout_s)
            if reward is None:
                raise ValueError(f"session {sid} was finished without a reward")
            return reward

        try:
            outcome = await self._outcome(finished())
        finally:
            self.endpoint.close(sid)
        if not offer.claimed:
            session.counts["unclaimed"] += 1
        return session, outcome

    async def _outcome(self, awaitable) -> tuple[str, str | None, float]:
        """``(termination, error, reward)`` of an agent run."""
        try:
            return "done", None, reward_of(await awaitable, self.spec)
        except TimeoutError:
            return "timeout", None, 0.0
        except Exception as e:  # the agent's failure ends its own run only
            return "env_error", f"{type(e).__name__}: {e}"[:500], 0.0

    def _finish(self, session, task: dict, termination: str, error: str | None, reward: float) -> Episode:
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
        if self.endpoint.counts["bad_requests"]:  # requests of no session (claims) are counted on the next sample
            ep.info["agent/bad_requests"] = ep.info.get("agent/bad_requests", 0) + self.endpoint.counts.pop(
                "bad_requests")
        if error:
            ep.info["error"] = error
        return ep
