"""Reward functions in TRL's `GRPOTrainer` signature, used by fleetrl unchanged (configs/smollm2_trl_rewards.yaml;
docs/your_model_and_data.md). Each takes the group's completions (strings, or assistant message lists for
conversational prompts) and the dataset's columns as keyword lists, and returns one score per completion."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def accuracy(completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the last number of the completion is the reference answer, 0.0 when it is another number, None (no
    score) when the reference is not a number."""
    out: list[float | None] = []
    for completion, ref in zip(completions, answer):
        if ref is None or not _NUMBER.fullmatch(str(ref).strip()):
            out.append(None)
            continue
        numbers = _NUMBER.findall(_text(completion).replace(",", ""))
        out.append(float(bool(numbers) and float(numbers[-1]) == float(ref)))
    return out


def concise(completions, **kwargs) -> list[float]:
    """A format reward: 1.0 for a reply of at most 40 words that ends with a number, else 0.0."""
    out = []
    for completion in completions:
        text = _text(completion).strip()
        out.append(float(len(text.split()) <= 40 and bool(re.search(r"\d[.!]?$", text))))
    return out
