"""The environment API users implement: one instance per episode.

    class MyEnv(Environment):
        def reset(self, task: dict, seed: int) -> list[Message]: ...      # the initial messages
        def step(self, action: Action) -> StepResult: ...                 # after every assistant turn
        def close(self) -> None: ...                                      # always called once

Each method may be a plain or an ``async def`` method: plain ones run in a thread, so a blocking environment
never blocks the other episodes of the rollout actor. ``task`` is the task row (the prompt's metadata plus
``prompt``); ``seed`` is the episode's seed. The action carries the exact token ids the engine sampled, their
text, the finish reason and the parsed tool calls. Register an environment with :func:`register_environment` or
give it as ``package.module:Class`` (``env.name``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from common.registry import Registry

Message = dict
"""``{"role": "system" | "user" | "assistant" | "tool", "content": str}`` (+ ``"name"`` on tool messages)."""


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = ""


@dataclass
class Action:
    """One assistant turn: the exact sampled tokens and what was parsed from them."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" or "length"
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class StepResult:
    observation: list[Message] = field(default_factory=list)  # messages appended after the turn
    reward: float = 0.0  # this turn's reward (on its last token for token-level estimators)
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment:
    def reset(self, task: dict, seed: int) -> list[Message]:
        raise NotImplementedError

    def step(self, action: Action) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        pass


ENVIRONMENTS = Registry("environment")
"""``env.name`` -> Environment class."""


def register_environment(name: str):
    return ENVIRONMENTS.register(name)


def load_environment(spec: str) -> type[Environment]:
    """A registered environment name, or ``package.module:Class``."""
    obj = ENVIRONMENTS.resolve(spec, "env.name")
    if not (inspect.isclass(obj) and issubclass(obj, Environment)):
        raise ValueError(f"env.name {spec!r} is not a workers.envs.api.Environment subclass")
    return obj


THREADS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="env")
"""Plain environment methods and tools run here: many, so that tools stuck past their timeout (a thread cannot be
killed) do not starve the rest."""


async def call(fn, *args, timeout_s: float | None = None, **kwargs):
    """Await ``fn(*args, **kwargs)``: directly when it is a coroutine function, else in a thread; past
    ``timeout_s`` raise ``asyncio.TimeoutError`` (a thread left running is abandoned)."""
    if inspect.iscoroutinefunction(fn):
        work = fn(*args, **kwargs)
    else:
        work = asyncio.get_running_loop().run_in_executor(THREADS, functools.partial(fn, *args, **kwargs))
    return await asyncio.wait_for(work, timeout_s)
