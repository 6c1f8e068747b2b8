"""Process reward models (PRM): a causal LM that scores every step of a solution.

The layout is Math-Shepherd's: the solution is cut into steps at the step separator, a fixed *tag* token is put
after every step, and the step's score is the model's probability of the tag at that position,
``p(tag | prompt, steps 1..k)``. Training (the learner's registered ``prm`` loss) is binary cross-entropy of that
probability against the step's label, so the tag is a fixed marker (it never carries the label into the context)
and the trained model stays an ordinary HF causal LM directory: vLLM, transformers and the learner load it as they
load any policy. ``fleetrl_prm.json`` beside the weights records the tag, the separator and what it was trained on.

An *outcome* reward model (ORM) is the same thing trained on the final correctness only (``prm.target: outcome``):
its score of a solution is the score of its last step.

:class:`PRMWorker` is a plain class; ``orchestrator.rl.pools.PRMPool`` makes it the `prm-i` (or `orm-i`) actors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from common.actor_logs import LoggedActor
from common.imports import skip_unused_imports

META_FILE = "fleetrl_prm.json"
AGGREGATIONS = ("min", "last", "prod")


def split_steps(completion: str, separator: str) -> list[str]:
    """The steps of a completion, each keeping the separator that ends it (the last may have none); empty and
    whitespace-only pieces are dropped. ``"42;49;70"`` -> ``["42;", "49;", "70"]``."""
    if not separator:
        raise ValueError("a step separator must be a non-empty string")
    pieces = completion.split(separator)
    steps = [p + separator for p in pieces[:-1]] + [pieces[-1]]
    return [s for s in steps if s.strip() and s.strip() != separator.strip()]


def aggregate(scores: list[float], how: str) -> float:
    """One score for a solution from its step scores: ``min`` (weakest step), ``last`` (the final step's score:
    the PRM's view of the outcome) or ``prod`` (the probability that every step is right, steps independent).
    A solution without steps scores 0."""
    if how not in AGGREGATIONS:
        raise ValueError(f"step-score aggregation {how!r}; valid: {list(AGGREGATIONS)}")
    if not scores:
        return 0.0
    if how == "min":
        return min(scores)
    if how == "last":
        return scores[-1]
    return math.prod(scores)


def tag_id(tokenizer, tag: str) -> int:
    """The tag's token id; a tag that is not exactly one token is an error."""
    ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"prm.tag {tag!r} is {len(ids)} tokens for this tokenizer; choose a single-token tag")
    return ids[0]


def tagged_steps(tokenizer, steps: list[str], tag: int) -> tuple[list[int], list[int]]:
    """``(completion ids, tag positions)``: each step's tokens followed by the tag; positions index the ids."""
    ids, positions = [], []
    for step in steps:
        ids += tokenizer(step, add_special_tokens=False)["input_ids"]
        positions.append(len(ids))
        ids.append(tag)
    return ids, positions


def encode(tokenizer, prompt: str, steps: list[str], tag: int) -> tuple[list[int], list[int], list[int]]:
    """``(prompt ids, completion ids, tag positions in the completion)`` of one solution: the one encoding that
    training and serving share. The prompt is the text the policy was given (its chat template already applied
    when it had one), tokenized as the rollout engine tokenizes a raw prompt."""
    completion, positions = tagged_steps(tokenizer, steps, tag)
    return tokenizer(prompt)["input_ids"], completion, positions


def write_meta(out_dir: str | Path, meta: dict) -> None:
    (Path(out_dir) / META_FILE).write_text(json.dumps(meta, indent=1))


def read_meta(path: str | Path) -> dict:
    """The PRM's ``fleetrl_prm.json`` (tag, separator, target); a directory without one is not a fleetrl PRM."""
    meta = Path(path) / META_FILE
    if not meta.exists():
        raise FileNotFoundError(f"{path}: no {META_FILE}; give a directory written by `fleetrl prm train` (its "
                                "final/)")
    return json.loads(meta.read_text())


class PRMWorker(LoggedActor):
    """Scores solutions step by step with a PRM directory; ``batch_size`` solutions per forward. Plain class."""

    def __init__(self, path: str, batch_size: int, torch_threads: int = 1):
        self._start_logging()
        skip_unused_imports()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(torch_threads)
        self.meta = read_meta(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.model.to(self.device)
        self.tag = tag_id(self.tokenizer, self.meta["tag"])
        self.batch_size = batch_size
        self.scored = 0

    def score(self, items: list[tuple[str, list[str]]]) -> list[list[float]]:
        """Per (prompt text, steps): the score of every step, in order."""
        out: list[list[float]] = []
        for i in range(0, len(items), self.batch_size):
            out += self._score_batch(items[i: i + self.batch_size])
        self.scored += len(items)
        return out

    def _score_batch(self, items: list[tuple[str, list[str]]]) -> list[list[float]]:
        import torch

        rows, tags = [], []
        for prompt, steps in items:
            prompt_ids, ids, positions = encode(self.tokenizer, prompt, steps, self.tag)
            rows.append(prompt_ids + ids)
            tags.append([len(prompt_ids) + p for p in positions])
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(rows):  # right padding: every row keeps positions 0..len-1
            ids[i, : len(r)] = torch.tensor(r)
            attn[i, : len(r)] = 1
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits.float()
        logp = torch.log_softmax(logits, -1)[..., self.tag].cpu()  # [b, L]: log p(tag) of the *next* position
        return [[float(logp[i, p - 1].exp()) for p in ps] for i, ps in enumerate(tags)]

    def stats(self) -> dict:
        import os

        return {"scored": self.scored, "pid": os.getpid()}
