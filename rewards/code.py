"""The ``code`` reward: the fraction of a task's stdin/stdout test cases the completion's program passes.

The program is the last fenced ```` ```python ```` block of the completion (``py`` and ``python3`` tags count
too), or the whole completion when it has none. Every case feeds ``input`` on stdin and compares stdout with
``output`` after stripping trailing whitespace per line and trailing newlines; a case also fails on a
non-zero exit, the wall-clock limit or too much output. All cases of one completion run in one sandbox
(:mod:`rewards.sandbox`), never in the reward actor's process.
"""

from __future__ import annotations

import re
from dataclasses import fields

from rewards.functions import register_reward
from rewards.sandbox import SandboxLimits, check_sandbox, run_tests

_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\r?\n(.*?)```", re.S)


def extract_program(completion: str) -> str:
    """The last ```` ```python ```` block of ``completion``, else all of it."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


@register_reward("code")
def code_reward(prompt: str, completion: str, metadata: dict, **params) -> float:
    """Fraction of ``metadata["tests"]`` (a list of ``{"input": str, "output": str}``) passed. ``params`` are
    :class:`rewards.sandbox.SandboxLimits` fields (defaults there): ``timeout_s`` (wall clock per case),
    ``memory_mb`` (per process), ``max_output_kb`` (stdout per case), ``max_procs`` (processes + threads),
    ``disk_mb`` (the sandbox's tmpfs), ``python`` (the interpreter). Raises
    :class:`rewards.sandbox.SandboxUnavailable` on a host that cannot sandbox."""
    tests = metadata.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"code reward: metadata['tests'] must be a non-empty list of "
                         f"{{'input': str, 'output': str}}, got {tests!r:.200}")
    limits = _limits(params)
    check_sandbox(limits.python)
    statuses = run_tests(extract_program(completion), tests, limits)
    return statuses.count("pass") / len(statuses)


def preflight(**params) -> None:
    """Run by a reward worker at start: bad params, or a host that cannot create the sandbox, fail there."""
    check_sandbox(_limits(params).python)


code_reward.preflight = preflight
code_reward.bounds_itself = True  # the program runs in a sandbox with its own time and memory limits


def _limits(params: dict) -> SandboxLimits:
    allowed = [f.name for f in fields(SandboxLimits)]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"code reward: unknown params {unknown}; allowed: {allowed}")
    return SandboxLimits(**params)
