"""Reward functions: ``fn(prompt, completion, metadata) -> float | dict[str, float]``, or TRL's signature.

A dict return is a set of named reward components (for GDPO); a float is one component named after the
function. Built-ins are registered by name in :data:`REWARD_FUNCTIONS`; a user function is named by its
import path ``package.module:function``.

A function that takes ``completions`` is called as TRL's ``GRPOTrainer`` calls its reward functions
(:class:`BatchedReward`): ``fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=...,
**columns) -> list[float | None]``, once per group of samples of one prompt; ``None`` is "no score" and leaves that
function out of the sample's weighted sum.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections import Counter
from collections.abc import Callable, Sequence

from common.registry import Registry
from rewards.answers import MAX_COMPLETION_CHARS, answer_regions, final_text, matches

log = logging.getLogger("fleetrl.reward")
RewardFn = Callable[[str, str, dict], "float | dict[str, float]"]
REWARD_FUNCTIONS = Registry("reward function")
register_reward = REWARD_FUNCTIONS.register

@register_reward("math")
def math_reward(prompt: str, completion: str, metadata: dict) -> float:
    """1.0 when the completion's one final answer is ``metadata["answer"]``, else 0.0: the final-answer rule of
    :mod:`rewards.answers` (a numeric reference needs a numeral, so ``64 + 95`` is not 159; a symbolic one is
    compared by math-verify's equivalence; reasoning in ``<think>`` is not the answer; candidate lists and
    disagreeing boxes are wrong). ``metadata["answer_form"]`` (``data.answer_form``) forces ``number`` or
    ``expression``."""
    return float(matches(completion, str(metadata["answer"]), metadata.get("answer_form", "auto"), prompt))


@register_reward("format")
def format_reward(prompt: str, completion: str, metadata: dict) -> float:
    """1.0 when the completion is one ``<think>...</think>`` block with some reasoning in it, followed by a
    non-empty answer without think tags (DeepSeek-R1), else 0.0."""
    text = completion.strip()
    return float(len(text) <= MAX_COMPLETION_CHARS and bool(_THINK_FORMAT.fullmatch(text))
                 and text.count("<think>") == 1 and text.count("</think>") == 1)


_THINK_FORMAT = re.compile(r"<think>\s*\S.*?</think>\s*\S.*", re.S)


@register_reward("length")
def length_reward(prompt: str, completion: str, metadata: dict, max_len: int = 512, cache: int = 128) -> float:
    """DAPO's soft overlong penalty on the completion's length in characters: 0 up to ``max_len - cache``,
    falling linearly to -1 at ``max_len``, -1 beyond."""
    n = len(completion)
    if n <= max_len - cache:
        return 0.0
    return max(-1.0, (max_len - cache - n) / max(cache, 1))


_CHOICE = re.compile(r"(?<![A-Za-z'])([A-J])(?![A-Za-z'])")
_WORD_LETTER = re.compile(r"(?<![A-Za-z'])([AI])(?=\s+[a-z]|')")  # "A good ...", "I think", "I'm": words


@register_reward("choice")
def choice_reward(prompt: str, completion: str, metadata: dict) -> float:
    """Multiple choice: 1.0 when the completion's stated answer (:func:`rewards.answers.answer_regions`: after
    "answer is", in a box or ``<answer>`` tag, else the last line) names exactly one option letter A-J and it is
    the answer letter; several letters (``A, B or C``) are no answer."""
    regions = answer_regions(completion)
    if not regions:
        return 0.0
    region = regions[-1] if len(regions) == 1 else " ".join(regions)
    if region == final_text(completion):
        region = region.strip().splitlines()[-1]
    letters = set(_CHOICE.findall(_WORD_LETTER.sub(" ", region)))
    return float(letters == {str(metadata["answer"]).strip().upper()})


def is_correct(verifier: RewardFn, prompt: str, completion: str, metadata: dict) -> bool:
    """Whether ``verifier`` (a reward function deciding correctness, e.g. a task's ``verifier_fn``) accepts the
    completion: a float value must be >= 1.0; a dict of components must be non-empty with every component
    >= 1.0 (all checks passed)."""
    value = verifier(prompt, completion, metadata)
    if isinstance(value, dict):
        return bool(value) and all(v >= 1.0 for v in value.values())
    return value >= 1.0


def verdicts(verifier: RewardFn, items: Sequence[tuple[str, str, dict]]) -> list[bool]:
    """:func:`is_correct` of every ``(prompt, completion, metadata)``, each call under the hard time and memory limit
    of :mod:`rewards.bounded` (the process's shared pool): a call past it is wrong, counted in the pool's
    ``timeouts`` and logged once. Every correctness decision of the driver goes through here."""
    from rewards.bounded import shared_pool

    outs = shared_pool().map((is_correct,), [(0, (verifier, p, c, m)) for p, c, m in items],
                             describe=lambda args: args[2])
    failed = next((o for o in outs if o.status == "error"), None)
    if failed is not None:
        log.warning("the verifier %s raised (scored as wrong): %s", getattr(verifier, "__name__", verifier),
                    str(failed.value).splitlines()[0])
    return [o.ok and bool(o.value) for o in outs]


def answer_keys(key_fn: Callable[[str], str | None], texts: Sequence[str]) -> list[str | None]:
    """``key_fn`` (a task's ``answer_key``) of every text for majority voting, under the same limit as
    :func:`verdicts`: a text past it states no answer."""
    from rewards.bounded import shared_pool

    outs = shared_pool().map((key_fn,), [(0, (t,)) for t in texts], describe=lambda args: args[0])
    return [o.value if o.ok else None for o in outs]


def majority_vote(answers: list[str | None]) -> int | None:
    """Index of the first sample whose answer is the most frequent one (self-consistency); samples without an
    answer (None) do not vote; None when no sample has one."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    return answers.index(winner)


def verify_timeouts() -> int:
    """Correctness decisions stopped at the limit so far in this process (``eval/verify_timeouts``)."""
    from rewards.bounded import shared_pool

    return shared_pool().timeouts


# Modules holding more built-ins (imported on first lookup, so importing this module stays light).
BUILTIN_MODULES: tuple[str, ...] = ("rewards.remote", "rewards.tasks", "rewards.code", "rewards.constitution")


def load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def is_batched(fn: Callable) -> bool:
    """Whether ``fn`` has TRL's reward signature: it takes a ``completions`` argument (a list)."""
    import inspect

    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return False


class BatchedReward:
    """A reward function with TRL's signature, called on a group of ``(prompt, completion, metadata)`` items at
    once: ``prompts`` and ``completions`` are strings, or message lists for a conversational prompt (a dataset row
    whose prompt was a message list; the completion is then ``[{"role": "assistant", "content": ...}]``); every
    metadata column (the dataset's other columns, ``answer`` reduced to the final answer) is a list keyword;
    ``completion_ids`` and ``trainer_state.global_step`` (the policy version that sampled them) come from
    ``extras``. Returns one ``float | None`` per item; another length or type is an error."""

    batched = True

    def __init__(self, fn: Callable, params: dict):
        import inspect

        self.fn, self.params = fn, params
        self.__name__ = getattr(fn, "__name__", "reward")
        ps = inspect.signature(fn).parameters.values()  # without **kwargs: only the keywords it names are passed
        self.takes = None if any(p.kind is p.VAR_KEYWORD for p in ps) else {p.name for p in ps}

    def __call__(self, items: Sequence[tuple[str, str, dict]],
                 extras: Sequence[tuple[list[int], int]] | None = None) -> list[float | None]:
        from types import SimpleNamespace

        conv = [isinstance(m.get(MESSAGES_KEY), list) for _, _, m in items]
        prompts = [m[MESSAGES_KEY] if c else p for (p, _, m), c in zip(items, conv)]
        completions = [[{"role": "assistant", "content": t}] if c else t for (_, t, _), c in zip(items, conv)]
        names = sorted({k for _, _, m in items for k in m if not k.startswith("_")})
        columns = {k: [m.get(k) for _, _, m in items] for k in names if k not in RESERVED}
        extras = list(extras or [([], 0)] * len(items))
        kwargs = {"prompts": prompts, "completions": completions, "completion_ids": [ids for ids, _ in extras],
                  "trainer_state": SimpleNamespace(global_step=max(v for _, v in extras)), **columns, **self.params}
        out = self.fn(**{k: v for k, v in kwargs.items() if self.takes is None or k in self.takes})
        if not isinstance(out, list | tuple) or len(out) != len(items):
            raise TypeError(f"returned {type(out).__name__} of length {len(out) if hasattr(out, '__len__') else '?'}"
                            f", not a list of {len(items)} scores (one per completion)")
        return [None if v is None else float(v) for v in out]


MESSAGES_KEY = "_prompt_messages"
"""Metadata key of a conversational prompt's messages (what :class:`BatchedReward` passes as its prompt)."""
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")
"""Keywords TRL's signature reserves: a dataset column of one of these names is not passed."""


def bind_reward_function(name: str, params: dict) -> Callable:
    """``name`` loaded and ``params`` bound to it: a ValueError naming the function when it does not import or
    cannot be called as ``fn(prompt, completion, metadata, **params)`` or, for TRL's signature
    (:func:`is_batched`), as ``fn(completions=..., **params)`` (then a :class:`BatchedReward`)."""
    import functools
    import inspect

    try:
        fn = load_reward_function(name)
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    except Exception as e:  # noqa: BLE001 - a plugin module may raise anything on import
        raise ValueError(f"reward function {name!r} does not import: {type(e).__name__}: {e}") from None
    if is_batched(fn):
        try:
            inspect.signature(fn).bind_partial(completions=[], **params)
        except TypeError as e:
            raise ValueError(f"reward function {name!r} (TRL's signature) cannot take "
                             f"{['completions', *params]} as keywords: {e}") from None
        return BatchedReward(fn, params)
    try:
        inspect.signature(fn).bind("prompt", "completion", {}, **params)
    except TypeError as e:
        raise ValueError(f"reward function {name!r} cannot be called as fn(prompt, completion, metadata"
                         f"{''.join(f', {k}=...' for k in params)}): {e}") from None
    except ValueError:  # no signature to read (a builtin): the call below decides
        pass
    return functools.partial(fn, **params)


def preflight_reward_function(name: str, params: dict, sample: tuple[str, str, dict]) -> None:
    """One call of the bound function on ``sample`` (prompt, completion, metadata) under the verification limits
    (:func:`rewards.bounded.shared_pool`): a raise, a timeout or a value that is not a number (or a dict of
    numbers) is a ValueError naming the function and what it did."""
    from rewards.bounded import shared_pool

    fn = bind_reward_function(name, params)
    batched = isinstance(fn, BatchedReward)
    out = shared_pool().map([fn], [(0, ([sample],) if batched else sample)])[0]
    if out.status == "timeout":
        raise ValueError(f"reward function {name!r} did not return within the limit on a sample of the task")
    if not out.ok:
        raise ValueError(f"reward function {name!r} raised on a sample of the task: "
                         f"{str(out.value).splitlines()[0]}")
    if batched and out.value == [None]:
        return
    values = out.value.values() if isinstance(out.value, dict) else out.value if batched else [out.value]
    if not values or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise ValueError(f"reward function {name!r} returned {out.value!r} on a sample of the task; it must return a "
                         "number (or a dict of numbers)")


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
