"""The training batch the learner consumes: typed tensors, no algorithm in it.

Layout: prompts left-padded to ``P`` columns, responses right-padded to ``T`` columns, so every response
starts at column ``P`` and per-token tensors are ``[B, T]``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from learner.losses import LossScale


@dataclass
class TrainBatch:
    # per sequence
    input_ids: Tensor  # [B, P + T] long: left-padded prompt | right-padded response
    attention_mask: Tensor  # [B, P + T] long
    prompt_len: int  # P
    # per token (response positions)
    response_mask: Tensor  # [B, T] float, 1 on response tokens
    rollout_logprobs: Tensor  # [B, T] the engine's logprobs of the sampled tokens
    advantages: Tensor | None = None  # [B, T]
    old_logprobs: Tensor | None = None  # [B, T] learner logprobs before the update
    ref_logprobs: Tensor | None = None  # [B, T] reference model logprobs
    returns: Tensor | None = None  # [B, T] value targets (critic)
    old_values: Tensor | None = None  # [B, T] critic values before the update
    targets: Tensor | None = None  # [B, T] labels in [0, 1] at the masked positions (PRM step labels)
    # global counts of the minibatch this shard belongs to (set by split)
    scale: LossScale | None = None
    # consecutive rows that must stay in one micro-batch and on one rank: 2 for preference pairs (DPO)
    rows_per_unit: int = 1

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_ids(self) -> Tensor:
        return self.input_ids[:, self.prompt_len:]

    def select(self, rows: slice | Tensor) -> TrainBatch:
        """Rows of every per-sequence and per-token tensor; scalars and ``scale`` unchanged."""
        changes = {f.name: getattr(self, f.name)[rows] for f in fields(self)
                   if isinstance(getattr(self, f.name), Tensor)}
        return replace(self, **changes)

    def to(self, device) -> TrainBatch:
        """Every tensor on ``device`` (this batch itself when it is the CPU)."""
        if str(device) == "cpu":
            return self
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})

    def with_scale(self) -> TrainBatch:
        """This batch as a whole minibatch: its own global counts. A batch of row units (preference pairs) counts
        only the rows that carry tokens, so filler pairs do not dilute the per-pair mean."""
        seqs = self.size if self.rows_per_unit == 1 else int((self.response_mask.sum(-1) > 0).sum())
        scale = LossScale(num_seqs=seqs, num_tokens=int(self.response_mask.sum()),
                          max_len=self.response_mask.shape[1])
        return replace(self, scale=scale)

    def shards(self, n: int) -> list[TrainBatch]:
        """Split rows into ``n`` equal contiguous shards that keep this batch's global ``scale`` (and whole units)."""
        if self.size % (n * self.rows_per_unit):
            raise ValueError(f"batch of {self.size} sequences does not split into {n} equal shards of whole "
                             f"{self.rows_per_unit}-row units")
        k = self.size // n
        return [self.select(slice(i * k, (i + 1) * k)) for i in range(n)]


def build_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], rollout_logprobs: list[list[float]],
                pad_id: int, loss_masks: list[list[int] | None] | None = None) -> TrainBatch:
    """Pack variable-length prompts and completions into the left|right padded layout. ``loss_masks[i]`` (one
    entry per completion token, or None for all ones) marks which completion tokens are trained: a multi-turn
    episode's completion interleaves sampled turns (1) with observations and template glue (0)."""
    B = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in completion_ids))
    ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + T), dtype=torch.long)
    mask = torch.zeros((B, T))
    lps = torch.zeros((B, T))
    for i, (p, c, lp) in enumerate(zip(prompt_ids, completion_ids, rollout_logprobs)):
        ids[i, P - len(p): P] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p): P + len(c)] = 1
        if c:
            ids[i, P: P + len(c)] = torch.tensor(c, dtype=torch.long)
            lm = loss_masks[i] if loss_masks is not None else None
            if lm is not None and not len(lm) == len(c) == len(lp):
                raise ValueError(f"sample {i}: {len(c)} completion ids, {len(lp)} logprobs, {len(lm)} mask entries")
            mask[i, : len(c)] = 1.0 if lm is None else torch.tensor(lm, dtype=mask.dtype)
            lps[i, : len(c)] = torch.tensor(lp) * mask[i, : len(c)]
    return TrainBatch(input_ids=ids, attention_mask=attn, prompt_len=P, response_mask=mask, rollout_logprobs=lps)


def response_logprobs(logits: Tensor, batch: TrainBatch, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-probabilities of the response tokens and the policy entropy at each response position.

    ``logits`` ``[b, P + T, V]`` from a causal LM over ``batch.input_ids``; returns ``([b, T], [b, T])``.
    """
    P = batch.prompt_len
    lg = logits[:, P - 1: -1].float() / temperature
    logp_all = torch.log_softmax(lg, dim=-1)
    logp = logp_all.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mask = batch.response_mask
    return logp * mask, entropy * mask


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted from each sequence's first real token (left padding)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)
