"""From a :class:`TrainBatch` micro-batch to what the model reads: packed rows and token-budget micro-batches.

Padded layout (the driver's): ``[b, P + T]``, prompts left-padded, responses right-padded, so one long sample
decides the memory of the whole micro-batch. Packed layout (the learner's): the real tokens of the samples
bin-packed (first-fit decreasing) into ``r <= b`` rows no longer than the micro-batch's longest sample, with
position ids that restart at 0 for each sample (a row's unused tail is one more short segment, never scored).
transformers' attention (SDPA on CPU, flash-attention varlen on GPU) detects the restarts and keeps attention
inside each sample, so the logits equal the padded ones.

Why rows capped at the longest sample, not one row of everything: SDPA on CPU attends over a whole row under a
block-diagonal mask, so its work is the square of the row length; one row of 32 samples costs ``(sum L)^2``
attention cells instead of ``sum L^2``. Capped rows never hold more positions (``r * W <= b * max L``) or
attention cells (``r * W^2 <= b * (max L)^2``) than the padded layout (:func:`layout_cost`;
``tests/test_packing.py`` checks it on random length mixes), and they drop most of the padding when lengths are
skewed.

Only response tokens are scored: :class:`Scored` lists, for each scored token, the packed position whose hidden
state predicts it (one before the token), the token id, and where it goes back in the ``[b, T]`` per-token
layout of the batch. The LM head then runs on those positions only.

Imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from learner.batch import TrainBatch, position_ids


@dataclass(frozen=True)
class Layout:
    """How the learner lays a micro-batch out for the model (``learner.*`` settings)."""

    packing: bool = True  # concatenate samples without padding (else the padded layout)
    chunk_tokens: int = 1024  # LM head + log-softmax this many tokens at a time; 0 = naive full-vocab logits
    micro_batch_tokens: int | None = None  # token budget per micro-batch (else learner.micro_batch_size rows)
    entropy: bool = True  # compute the policy entropy for logging (always when it is weighted in the loss)


@dataclass
class Scored:
    """The response tokens a forward pass scores, and where their results go."""

    hidden_index: Tensor  # [N] long: position (in the model's flattened [rows * cols] output) predicting the token
    targets: Tensor  # [N] long: the token ids
    rows: Tensor  # [N] long: row in the micro-batch
    cols: Tensor  # [N] long: column in the [b, T] response layout

    def scatter(self, values: Tensor, shape: tuple[int, ...]) -> Tensor:
        """Per-token ``values`` ``[N]`` into a zero ``[b, T]`` tensor (keeps the autograd graph)."""
        out = torch.zeros(shape, dtype=values.dtype, device=values.device)
        return out.index_put((self.rows.to(values.device), self.cols.to(values.device)), values)


@dataclass
class ModelInput:
    """Keyword arguments of the model's forward (``attention_mask`` None when packed) and the tokens to score."""

    input_ids: Tensor  # [1, L] packed, or [b, P + T] padded
    position_ids: Tensor  # same shape
    attention_mask: Tensor | None
    scored: Scored

    def kwargs(self, device) -> dict:
        # no KV cache: with one, transformers does not look for packed sequences in the position ids
        out = {"input_ids": self.input_ids.to(device), "position_ids": self.position_ids.to(device),
               "use_cache": False}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask.to(device)
        return out


def scored_cells(mb: TrainBatch) -> tuple[Tensor, Tensor]:
    """``(rows, cols)`` of the response tokens that count (``response_mask > 0``). A micro-batch with none (every
    row masked, e.g. RFT's filler rows) scores its first response cell with mask 0, so the forward still touches
    every parameter and the loss stays in the graph while contributing nothing."""
    rows, cols = torch.nonzero(mb.response_mask > 0, as_tuple=True)
    if rows.numel() == 0:
        rows, cols = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    return rows, cols


def padded_input(mb: TrainBatch) -> ModelInput:
    """The padded layout as is (the reference path packing is tested against)."""
    rows, cols = scored_cells(mb)
    width = mb.input_ids.shape[1]
    hidden_index = rows * width + (mb.prompt_len - 1 + cols)
    scored = Scored(hidden_index, mb.response_ids[rows, cols], rows, cols)
    return ModelInput(mb.input_ids, position_ids(mb.attention_mask), mb.attention_mask, scored)


def pack_rows(lengths: list[int], cap: int) -> list[list[int]]:
    """First-fit decreasing: sample indices grouped into rows of at most ``cap`` tokens (a longer sample gets a
    row of its own); each row keeps its samples in index order."""
    rows: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for r, u in enumerate(used):
            if u + lengths[i] <= cap:
                rows[r].append(i)
                used[r] += lengths[i]
                break
        else:
            rows.append([i])
            used.append(lengths[i])
    return [sorted(row) for row in rows]


def packed_input(mb: TrainBatch) -> ModelInput:
    """The micro-batch's real tokens (prompt and response, no padding) bin-packed into rows no longer than its
    longest sample (:func:`pack_rows`), positions restarting per sample; a row's unused tail continues as one
    more segment (positions from 0) of repeated last tokens, never scored. A row's response starts
    ``prompt_len_i`` tokens into its segment."""
    attn = mb.attention_mask.bool()
    lengths = attn.sum(-1)  # [b] real tokens per row
    prompt_lens = attn[:, : mb.prompt_len].sum(-1)  # [b]
    plan = pack_rows(lengths.tolist(), int(lengths.max()))
    width = max(int(lengths[row].sum()) for row in plan)
    ids = torch.zeros(len(plan), width, dtype=mb.input_ids.dtype)
    pos = torch.zeros(len(plan), width, dtype=torch.long)
    flat_start = torch.zeros_like(lengths)  # [b] where each sample starts in the flattened [rows * width] output
    for r, row in enumerate(plan):
        at = 0
        for i in row:
            n = int(lengths[i])
            ids[r, at:at + n] = mb.input_ids[i][attn[i]]
            pos[r, at:at + n] = torch.arange(n)
            flat_start[i] = r * width + at
            at += n
        if at < width:
            ids[r, at:] = ids[r, at - 1]
            pos[r, at:] = torch.arange(width - at)
    rows, cols = scored_cells(mb)
    hidden_index = flat_start[rows] + prompt_lens[rows] - 1 + cols
    scored = Scored(hidden_index, mb.response_ids[rows, cols], rows, cols)
    return ModelInput(ids, pos, None, scored)


def layout_cost(x: ModelInput) -> tuple[int, int]:
    """``(positions, attention cells)`` a forward over ``x`` computes: every position of the input tensor passes
    the matmuls; SDPA scores ``width^2`` query-key cells per row (masked or not)."""
    rows, width = x.input_ids.shape
    return rows * width, rows * width * width


def token_counts(batch: TrainBatch) -> list[int]:
    """Real tokens (prompt + response) of each row."""
    return batch.attention_mask.sum(-1).tolist()


def plan_micro_batches(counts: list[int], budget: int) -> list[list[int]]:
    """Consecutive rows grouped into micro-batches of at most ``budget`` real tokens each (a row longer than the
    budget gets a micro-batch of its own). Greedy in row order."""
    plan: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(counts):
        if current and used + n > budget:
            plan.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        plan.append(current)
    return plan


def micro_batches(shard: TrainBatch, size: int, token_budget: int | None, count: int | None = None) -> list[TrainBatch]:
    """The shard's micro-batches: ``size`` rows each, or (``token_budget`` set) at most that many real tokens
    each. ``count`` (>= the planned number) pads the list with :func:`filler` micro-batches, so every rank runs
    the same number of forward passes (ZeRO-3 gathers parameters collectively in each)."""
    u = shard.rows_per_unit  # rows that stay together (a preference pair): plan over units, then expand
    if token_budget:
        counts = token_counts(shard)
        plan = plan_micro_batches([sum(counts[i: i + u]) for i in range(0, shard.size, u)], token_budget)
    else:
        units, per = shard.size // u, max(1, -(-size // u))
        plan = [list(range(i, min(i + per, units))) for i in range(0, units, per)]
    out = [shard.select(torch.tensor([k * u + j for k in units_ for j in range(u)])) for units_ in plan]
    return out + [filler(shard)] * max(0, (count or 0) - len(out))


def filler(shard: TrainBatch) -> TrainBatch:
    """An empty micro-batch: the shard's first unit (row, or pair) with response mask 0 (a forward pass that adds
    nothing)."""
    empty = shard.select(slice(0, shard.rows_per_unit))
    empty.response_mask = torch.zeros_like(empty.response_mask)
    return empty
