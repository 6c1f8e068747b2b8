"""A math agent with a calculator and a python tool, written only against the ``openai`` client: the agent code a
user already has. It runs unchanged against any OpenAI-compatible server, and trains with fleetrl as the
environment (``env.agent: examples.math_agent:solve``, ``configs/smollm2_agent.yaml``): fleetrl hands ``solve`` a
client whose calls its rollout engines answer, and trains on exactly the tokens they sampled.

    python -m examples.math_agent --base-url http://127.0.0.1:8000/v1 --model M [--n 20]   # e.g. after `vllm serve M`

The task rows are fleetrl's ``tool_choice`` problems (a multiplication for the calculator, a letter count for
python); the reward is the agent's own check of its final answer.
"""

from __future__ import annotations

import ast
import json
import operator
import re

SYSTEM = (
    "You have two tools. The calculator evaluates arithmetic:\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "347*58"}}</tool_call>\n'
    "The python tool runs a program and returns what it prints:\n"
    '<tool_call>{"name": "python", "arguments": {"code": "print(len(\'abc\'))"}}</tool_call>\n'
    "Call the one you need and stop; its result comes back as a tool message. Then reply with the final number only."
)
TOOLS = [
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                      "parameters": {"type": "object", "required": ["expression"],
                                                     "properties": {"expression": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "python", "description": "Run a Python program; returns its stdout.",
                                      "parameters": {"type": "object", "required": ["code"],
                                                     "properties": {"code": {"type": "string"}}}}},
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only integer arithmetic")

    return str(ev(ast.parse(expression, mode="eval").body))


def python(code: str) -> str:
    # model-written code never runs in this process: any sandbox does; this one ships with fleetrl
    from rewards.sandbox import run_program

    status, out = run_program(code)
    return out if status == "ok" else f"error: {status}"


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
        return {"calculator": calculator, "python": python}[name](**args)
    except Exception as e:  # the model's bad call is an observation, not a crash
        return f"error: {type(e).__name__}: {e}"


def correct(reply: str | None, answer: str) -> bool:
    numbers = re.findall(r"-?\d+", reply or "")
    return bool(numbers) and numbers[-1] == str(answer)


async def solve(client, task: dict, model: str = "policy", max_turns: int = 3, transcript: list | None = None,
                **sampling) -> float:
    """Ask, run the tools the model calls, and return 1.0 when the final reply's last number is the answer
    (``transcript``, when given, gets the conversation's messages)."""
    messages = transcript if transcript is not None else []
    messages += [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=64,
                                                     **sampling)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(correct(message.content, task["answer"]))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    return 0.0


def evaluate(solve_fn, description: str, **sampling) -> None:
    """``python -m <agent> --base-url URL --model M [--n N] [--out FILE]``: the agent on the ``tool_choice`` task's
    first N held-out problems against any OpenAI-compatible server; prints its accuracy and tool-call rates and
    writes every conversation to ``--out``. ``solve_fn(client, task, model, transcript=list)``."""
    import argparse
    import asyncio

    import openai

    from rewards.tasks import ToolChoiceTask

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--out", help="JSONL: each problem's conversation and reward")
    args = ap.parse_args()
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key)
    tasks = [{**p.metadata, "prompt": p.text} for p in ToolChoiceTask().eval_set(args.n)]
    transcripts: list[list] = [[] for _ in tasks]

    async def run():
        return await asyncio.gather(*(solve_fn(client, t, args.model, transcript=m, **sampling)
                                      for t, m in zip(tasks, transcripts)))

    rewards = asyncio.run(run())
    first = [next((c["function"]["name"] for m in ms for c in m.get("tool_calls") or []), None) for ms in transcripts]
    called = [(name, t.get("tool")) for name, t in zip(first, tasks) if name]
    if args.out:
        with open(args.out, "w") as f:
            for t, ms, r in zip(tasks, transcripts, rewards):
                f.write(json.dumps({"task": t, "reward": r, "messages": ms}) + "\n")
    print(json.dumps({"n": len(rewards), "accuracy": sum(rewards) / len(rewards),
                      "tool_call_rate": len(called) / len(tasks),
                      "right_tool_rate": sum(name == tool for name, tool in called) / max(len(called), 1)}))


if __name__ == "__main__":
    evaluate(solve, __doc__.splitlines()[0], temperature=0.0)  # greedy: an evaluation
