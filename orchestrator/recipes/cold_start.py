"""Cold-start data (DeepSeek-R1's first stage): verified step-by-step answers for the built-in tasks, written as
SFT rows ``{"prompt", "response"}`` with the response ``<think>steps</think>`` + the final answer.

The steps come from each task's known solution: the digit-by-digit sum with its carries for ``arithmetic``, the
solution expression's operations in evaluation order for ``countdown``. Prompts are the task's own training
prompts (same text as in RL, never the held-out split), and every row is checked with the task's verifier and
the ``format`` reward before it is written.
"""

from __future__ import annotations

import ast
import random
from fractions import Fraction
from pathlib import Path

from rewards.functions import format_reward, load_reward_function
from rewards.tasks import ArithmeticTask, CountdownTask, make_task_from_config


def addition_steps(a: int, b: int, compact: bool) -> str:
    """Column addition from the units up: ``7+8=15 4+3+1=8`` (compact) or one line per column in words."""
    da, db = str(a)[::-1], str(b)[::-1]
    carry, steps = 0, []
    names = ["Units", "Tens", "Hundreds", "Thousands"]
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        total = x + y + carry
        if compact:
            steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}")
        else:
            name = names[i] if i < len(names) else f"Column {i + 1}"
            steps.append(f"{name}: {x} + {y}" + (f" + {carry} (carry)" if carry else "") + f" = {total}, write "
                         f"{total % 10}" + (", carry 1." if total >= 10 else "."))
        carry = total // 10
    if not compact and carry:
        steps.append(f"The final carry gives the leading 1, so the sum is {a + b}.")
    return " ".join(steps) if compact else "\n".join(steps)


def expression_steps(expr: str) -> list[str]:
    """The operations of an integer expression in evaluation order, ``a op b = v`` each."""
    steps: list[str] = []

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        left, right = value(node.left), value(node.right)
        op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}[type(node.op)]
        out = {"+": left + right, "-": left - right, "*": left * right, "/": left / right if right else 0}[op]
        steps.append(f"{_num(left)} {op} {_num(right)} = {_num(out)}")
        return out

    value(ast.parse(expr, mode="eval").body)
    return steps


def _num(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def cold_start_row(task, prompt: str, metadata: dict) -> dict:
    """One SFT row for a training prompt of ``task``."""
    if isinstance(task, ArithmeticTask):
        a, b = (int(t) for t in metadata["operands"])
        compact = task.prompt_style == "compact"
        steps = addition_steps(a, b, compact)
        response = f"<think>{steps}</think>{a + b}" if compact else f"<think>\n{steps}\n</think>\n{a + b}"
    elif isinstance(task, CountdownTask):
        if task.prompt_style == "compact":
            raise ValueError("cold-start data for countdown needs data.prompt_style=text (the compact vocabulary "
                             "has no <think> tags or words)")
        steps = "\n".join(expression_steps(metadata["solution"]))
        response = f"<think>\n{steps}\n</think>\n<answer> {metadata['solution']} </answer>"
    else:
        raise ValueError(f"cold-start data: no known step-by-step solution for task {type(task).__name__}; "
                         "supported: arithmetic, countdown")
    return {"prompt": prompt, "response": response}


def cold_start_rows(data_cfg, n: int, seed: int = 0) -> list[tuple[dict, dict]]:
    """``n`` (row, the prompt's metadata) for ``data_cfg``'s built-in task, from its training split; every row is
    checked with the task's verifier and the format reward."""
    task = make_task_from_config(data_cfg)
    verifier = load_reward_function(task.verifier)
    rng = random.Random(f"cold-start:{seed}")
    out = []
    for prompt, meta in task.draw_train(rng, n):
        row = cold_start_row(task, prompt, meta)
        if verifier(prompt, row["response"], meta) < 1.0 or format_reward(prompt, row["response"], meta) < 1.0:
            raise AssertionError(f"cold-start row failed its own verifier: {row}")
        out.append((row, meta))
    return out


def write_cold_start(data_cfg, n: int, out: str | Path, seed: int = 0) -> dict:
    """:func:`cold_start_rows` written as JSONL; returns a summary."""
    from orchestrator.data import write_jsonl

    if n < 1:
        raise ValueError(f"--n {n}: write at least 1 row")
    rows = [row for row, _ in cold_start_rows(data_cfg, n, seed)]
    write_jsonl(out, rows)
    return {"task": data_cfg.task, "rows": len(rows), "out": str(out), "example": rows[0]}
