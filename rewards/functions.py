"""Reward functions: ``fn(prompt, completion, metadata) -> float | dict[str, float]``.

A dict return is a set of named reward components (for GDPO); a float is one component named after the
function. Built-ins are registered by name in :data:`REWARD_FUNCTIONS`; a user function is named by its
import path ``package.module:function``.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable

from workers.registry import Registry

RewardFn = Callable[[str, str, dict], "float | dict[str, float]"]
REWARD_FUNCTIONS = Registry("reward function")
register_reward = REWARD_FUNCTIONS.register

_PLAIN_INT = re.compile(r"-?[0-9]{1,1000}")  # bounded: int() refuses strings of over 4300 digits


def parse_answer(text: str) -> list:
    r"""The final answer of a completion as math-verify extracts it: ``[value, matched text]`` (a sympy value),
    ``[]`` when there is none. LaTeX (``\boxed{}`` first, ``$\frac{6}{8}$``) and plain expressions and numbers
    (``The answer is 42.``) are understood. A GSM8K ending (the text after the last ``####`` is one line) names
    the answer explicitly, so that line is parsed alone (math-verify has no rule for ``####``: on the whole text
    it would prefer an earlier ``\boxed{}``, or the last number of ``#### 8 (3 + 5)``); when that finds nothing
    the whole text is parsed.

    Parsing runs without math-verify's signal-based timeout (``parsing_timeout=None``): reward functions run in
    non-main threads of Ray actors, where ``signal.alarm`` fails; the reward worker's own timeout bounds a call.
    """
    from math_verify import parse

    ending = text.rpartition("####")[2].strip() if "####" in text else ""
    if ending and "\n" not in ending:
        parsed = parse(ending, extraction_config=_extraction_config(), parsing_timeout=None)
        if parsed:
            return parsed
    return parse(text, extraction_config=_extraction_config(), parsing_timeout=None)


@functools.cache
def _extraction_config() -> tuple:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return (LatexExtractionConfig(), ExprExtractionConfig())


def extract_answer(text: str) -> str | None:
    """The text of the final answer :func:`parse_answer` finds (e.g. ``\\frac{6}{8}``, ``42``); None when none."""
    parsed = parse_answer(text)
    return parsed[-1] if parsed else None


@functools.lru_cache(maxsize=4096)
def _parse_reference(reference: str) -> list:
    """A reference answer parsed as one LaTeX math expression (cached: a prompt's G samples share it)."""
    from math_verify import parse

    return parse(f"${reference}$", parsing_timeout=None)


def _verify(gold: list, pred: list) -> bool:
    from math_verify import verify

    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def answers_equal(given: str, reference: str) -> bool:
    """Mathematical equivalence through math-verify (so 1/2, 0.5 and \\frac{1}{2} agree)."""
    if given.strip() == reference.strip():
        return True
    a, b = _plain_number(given), _plain_number(reference)
    if a is not None and b is not None:  # fast path: two plain decimals
        return a == b
    return _verify(_parse_reference(reference), _parse_reference(given))


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
    """1.0 when the completion's final answer (:func:`parse_answer`) equals ``metadata["answer"]``
    mathematically (math-verify's ``verify``), else 0.0. A completion and a reference that are both plain
    integers (``57``, the embedded model's answers) are compared as integers, which is what math-verify
    concludes for them too, only without parsing. A reasoning completion (``<think>...</think> answer``,
    DeepSeek-R1) is graded on what follows its last ``</think>``: the steps are not the answer."""
    given, reference = final_part(completion), str(metadata["answer"]).strip()
    completion = given
    if _PLAIN_INT.fullmatch(given) and _PLAIN_INT.fullmatch(reference):
        return float(int(given) == int(reference))
    return float(_verify(_parse_reference(reference), parse_answer(completion)))


def final_part(completion: str) -> str:
    """What follows the completion's last ``</think>`` (the whole completion when it has none), stripped."""
    return completion.rpartition("</think>")[2].strip()


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


def is_correct(verifier: RewardFn, prompt: str, completion: str, metadata: dict) -> bool:
    """Whether ``verifier`` (a reward function deciding correctness, e.g. a task's ``verifier_fn``) accepts the
    completion: a float value must be >= 1.0; a dict of components must be non-empty with every component
    >= 1.0 (all checks passed)."""
    value = verifier(prompt, completion, metadata)
    if isinstance(value, dict):
        return bool(value) and all(v >= 1.0 for v in value.values())
    return value >= 1.0


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
