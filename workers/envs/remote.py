"""Environments in their own Ray actors (``env.num_workers`` > 0), for heavy environments (a browser, a database,
a simulator): the ``env-i`` actors host the environment instances, the rollout actors' episodes reach theirs
through :class:`RemoteEnv`, and ``fleetrl scale --env N`` resizes the pool between steps like the other pools.

An :class:`EnvWorker` is an async Ray actor: it serves the calls of many episodes at once (each episode's methods
run as in the rollout actor: async ones on its loop, plain ones and tools in threads)."""

from __future__ import annotations

import itertools

from common.actor_logs import LoggedActor
from workers.envs.api import Action, Environment, Message, StepResult, call
from workers.envs.tool_env import make_environment


class EnvWorker(LoggedActor):
    def __init__(self, env: dict):
        self._start_logging()
        self.make = lambda: make_environment(env)
        self.envs: dict[str, Environment] = {}

    async def reset(self, key: str, task: dict, seed: int) -> list[Message]:
        self.envs[key] = self.make()
        return await call(self.envs[key].reset, task, seed)

    async def step(self, key: str, action: Action) -> StepResult:
        return await call(self.envs[key].step, action)

    async def close(self, key: str) -> None:
        env = self.envs.pop(key, None)
        if env is not None:
            await call(env.close)

    def open_episodes(self) -> int:
        return len(self.envs)


class RemoteEnv(Environment):
    """One episode's environment living in an ``env-i`` actor (Ray ObjectRefs are awaitable)."""

    keys = itertools.count()

    def __init__(self, actor, prefix: str):
        self.actor, self.key = actor, f"{prefix}-{next(self.keys)}"

    async def reset(self, task: dict, seed: int) -> list[Message]:
        return await self.actor.reset.remote(self.key, task, seed)

    async def step(self, action: Action) -> StepResult:
        return await self.actor.step.remote(self.key, action)

    async def close(self) -> None:
        await self.actor.close.remote(self.key)
