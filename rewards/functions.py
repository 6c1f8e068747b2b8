"""Reward functions: ``fn(prompt, completion, metadata) -> float | dict[str, float]``.

A dict return is a set of named reward components (for GDPO); a float is one component named after the
function. Built-ins are registered by name in :data:`REWARD_FUNCTIONS`; a user function is named by its
import path ``package.module:function``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from learner.registry import Registry

RewardFn = Callable[[str, str, dict], "float | dict[str, float]"]
REWARD_FUNCTIONS = Registry("reward function")
register_reward = REWARD_FUNCTIONS.register

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")



def extract_answer(text: str) -> str | None:
    r"""The final answer of a completion: the last ``\boxed{...}``, else what follows ``####``, else the last
    number; None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def answers_equal(given: str, reference: str) -> bool:
    """Mathematical equivalence through math-verify (so 1/2, 0.5 and \\frac{1}{2} agree)."""
    if given.strip() == reference.strip():
        return True
    a, b = _plain_number(given), _plain_number(reference)
    if a is not None and b is not None:  # fast path: two plain decimals
        return a == b
    from math_verify import parse, verify

    def wrap(s: str):
        return parse(f"${s}$", parsing_timeout=None)

    gold, pred = wrap(reference), wrap(given)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def _plain_number(s: str):
    from decimal import Decimal, InvalidOperation

    s = s.strip()
    if not re.fullmatch(r"-?\d+(\.\d+)?", s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


@register_reward("math")
def math_reward(prompt: str, completion: str, metadata: dict) -> float:
    """1.0 when the completion's final answer equals ``metadata["answer"]`` mathematically, else 0.0."""
    given = extract_answer(completion)
    return float(given is not None and answers_equal(given, str(metadata["answer"])))


@register_reward("format")
def format_reward(prompt: str, completion: str, metadata: dict) -> float:
    """1.0 when the completion is ``<think>...</think>`` followed by a non-empty answer (DeepSeek-R1), else 0.0."""
    return float(bool(_THINK_FORMAT.fullmatch(completion.strip())))


_THINK_FORMAT = re.compile(r"<think>.+?</think>\s*\S.*", re.S)


@register_reward("length")
def length_reward(prompt: str, completion: str, metadata: dict, max_len: int = 512, cache: int = 128) -> float:
    """DAPO's soft overlong penalty on the completion's length in characters: 0 up to ``max_len - cache``,
    falling linearly to -1 at ``max_len``, -1 beyond."""
    n = len(completion)
    if n <= max_len - cache:
        return 0.0
    return max(-1.0, (max_len - cache - n) / max(cache, 1))


_CHOICE = re.compile(r"\b([A-J])\b")


@register_reward("choice")
def choice_reward(prompt: str, completion: str, metadata: dict) -> float:
    """Multiple choice: 1.0 when the last standalone capital letter A-J of the completion is the answer letter."""
    letters = _CHOICE.findall(completion)
    return float(bool(letters) and letters[-1] == str(metadata["answer"]).strip().upper())


# Modules holding more built-ins (imported on first lookup, so importing this module stays light).
BUILTIN_MODULES: tuple[str, ...] = ("rewards.remote", "rewards.tasks", "rewards.code")


def load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def load_reward_function(name: str) -> RewardFn:
    """A built-in by name, or a user function by import path ``pkg.module:function``."""
    load_builtins()
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    if ":" not in name:
        raise KeyError(f"unknown reward function {name!r}; built-ins: {sorted(REWARD_FUNCTIONS)}, "
                       "or give an import path like 'mypkg.rewards:score'")
    module, attr = name.split(":", 1)
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise KeyError(f"reward function {name!r}: {module} has no callable {attr!r}")
    return fn
