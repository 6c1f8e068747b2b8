"""The stock tool environment: the model calls tools, each call's result is appended as a ``tool`` message; a turn
without a tool call ends the episode (its text is the answer the reward actors score)."""

from __future__ import annotations

import asyncio
import dataclasses

from workers.envs.api import Action, Environment, Message, StepResult, load_environment, register_environment
from workers.envs.tools import Tool, ToolResult, load_tool, run_tool


@register_environment("tool")
class ToolEnv(Environment):
    def __init__(self, tools: list[Tool]):
        self.tools = {t.name: t for t in tools}

    def reset(self, task: dict, seed: int) -> list[Message]:
        return [{"role": "user", "content": task["prompt"]}] if isinstance(task["prompt"], str) else \
            list(task["prompt"])

    async def step(self, action: Action) -> StepResult:
        if not action.tool_calls:
            return StepResult(done=True)
        results = await asyncio.gather(*(self._run(c.name, c.arguments) for c in action.tool_calls))
        observation = [{"role": "tool", "name": c.name, "content": r.error or r.output, "error": r.error is not None}
                       for c, r in zip(action.tool_calls, results)]
        calls = [{"name": c.name, "seconds": r.seconds, "error": r.error} for c, r in zip(action.tool_calls, results)]
        return StepResult(observation=observation, info={"tool_calls": calls})

    async def _run(self, name: str, arguments: dict) -> ToolResult:
        if name not in self.tools:
            return ToolResult("", f"unknown tool {name!r}; available: {sorted(self.tools)}", 0.0)
        return await run_tool(self.tools[name], arguments)


def env_tools(env: dict) -> list[Tool]:
    """The ``env.tools`` of an ``env`` config section (a dict), with its timeout and output cap."""
    return [dataclasses.replace(load_tool(t), timeout_s=env["tool_timeout_s"],
                                max_output_chars=env["max_tool_output_chars"]) for t in env["tools"]]


def make_environment(env: dict) -> Environment:
    """A fresh environment of an ``env`` config section (the stock ``tool`` one gets ``env.tools``)."""
    cls = load_environment(env["name"])
    return cls(env_tools(env), **env["args"]) if env["name"] == "tool" else cls(**env["args"])
