"""Tool demonstrations: SFT conversations in which the assistant calls the right tool with the right arguments,
reads the tool's real result and answers with it (the supervised warm-up before tool RL on a chat model).

    fleetrl data tool-demos -c configs/smollm2_tools.yaml --n 400 --out data/tool_demos.jsonl

Each row is ``{"messages": [user, assistant (a hermes <tool_call>), tool (the result the real tool returns),
assistant (the answer)], "tools": [names]}`` for a training prompt of the config's built-in task (never the
held-out split). The call is written exactly as the tool environment parses it (``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``), the result is the tool's own output, and every row's answer is checked with
the task's verifier before it is written. SFT trains the assistant turns only (the tool message, the prompt and the
template's glue are masked: :class:`orchestrator.data.ExampleRenderer`).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

from orchestrator.config import ConfigError, FleetConfig
from rewards.functions import load_reward_function
from rewards.tasks import ArithmeticTask, MultiplyTask, ToolChoiceTask, make_task_from_config
from workers.envs.tools import load_tool, run_tool


def tool_call_text(name: str, arguments: dict) -> str:
    """An assistant turn that calls ``name``, as :class:`workers.envs.renderers.ChatTemplateRenderer` parses it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def demo_call(task, meta: dict, tools: list[str]) -> tuple[str, dict]:
    """The tool and arguments that solve a prompt of ``task``: the calculator on the problem's expression, or the
    python tool printing it when only that is configured; for ``tool_choice`` the problem's own tool (a letter
    count is ``print('<text>'.count('<letter>'))`` in python)."""
    if isinstance(task, ToolChoiceTask):
        if meta["tool"] not in tools:
            raise ConfigError(f"env.tools: {tools}; task tool_choice needs both calculator and python")
        if meta["kind"] == "count":
            return "python", {"code": f"print({meta['text']!r}.count({meta['letter']!r}))"}
        return "calculator", {"expression": f"{meta['a']}*{meta['b']}"}
    if isinstance(task, MultiplyTask):
        expression = f"{meta['a']}*{meta['b']}"
    elif isinstance(task, ArithmeticTask):
        expression = "+".join(str(x) for x in meta["operands"])
    else:
        raise ConfigError(f"fleetrl data tool-demos: no known tool solution for task {task.name!r}; supported: "
                          "multiply, arithmetic, tool_choice")
    if "calculator" in tools:
        return "calculator", {"expression": expression}
    if "python" in tools:
        return "python", {"code": f"print({expression})"}
    raise ConfigError(f"env.tools: {tools} has neither calculator nor python, which tool-demos know how to call")


def tool_demo_rows(cfg: FleetConfig, n: int, seed: int = 0) -> list[dict]:
    """``n`` demonstrations for ``cfg``'s task and ``env.tools``; each answer checked with the task's verifier."""
    if cfg.env.name != "tool":
        raise ConfigError("fleetrl data tool-demos: the config needs env.name: tool (and env.tools)")
    task = make_task_from_config(cfg.data)
    verifier = load_reward_function(task.verifier)
    rng = random.Random(f"tool-demos:{seed}")
    rows = []
    for prompt, meta in task.draw_train(rng, n):
        name, arguments = demo_call(task, meta, cfg.env.tools)
        result = asyncio.run(run_tool(load_tool(name), arguments))
        answer = result.output.strip().splitlines()[-1] if result.output.strip() else ""
        if result.error or verifier(prompt, answer, meta) < 1.0:
            raise AssertionError(f"tool demo for {prompt!r} failed its own check: {name}({arguments}) -> {result}")
        rows.append({"messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": tool_call_text(name, arguments)},
                                  {"role": "tool", "name": name, "content": result.output},
                                  {"role": "assistant", "content": answer}],
                     "tools": list(cfg.env.tools)})
    return rows


def write_tool_demos(cfg: FleetConfig, n: int, out: str | Path, seed: int = 0) -> dict:
    """:func:`tool_demo_rows` written as JSONL; returns a summary."""
    rows = tool_demo_rows(cfg, n, seed)
    from orchestrator.data import write_jsonl

    write_jsonl(out, rows)
    return {"task": cfg.data.task, "rows": len(rows), "out": str(out), "example": rows[0]}
