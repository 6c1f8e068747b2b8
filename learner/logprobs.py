"""Log-probabilities and entropy of sampled tokens from hidden states, a chunk of tokens at a time.

For ``N`` scored tokens, hidden size ``H`` and vocabulary ``V``, the naive path builds fp32 logits ``[N, V]``,
a log-softmax of the same size, and (for the entropy) its exponential, all kept for backward: at ``V`` = 49 152
that is ~0.6 MB per token, tens of GB for a long micro-batch. Here the LM head runs on ``chunk`` tokens at a
time and each chunk is wrapped in activation checkpointing, so only the hidden states ``[N, H]`` are kept for
backward; the chunk's logits are recomputed there. Per token:

    logp(y) = z_y / tau - logsumexp(z / tau),   H = logsumexp(z / tau) - sum_v p_v z_v / tau

Results equal :func:`naive_token_logprobs` (the full log-softmax) to float rounding. Imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _chunk(head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, temperature: float,
           with_entropy: bool) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float() / temperature  # [n, V]
    lse = torch.logsumexp(logits, dim=-1)  # [n]
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    probs = torch.softmax(logits, dim=-1)
    return logp, lse - (probs * logits).sum(-1)


def token_logprobs(head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, temperature: float = 1.0,
                   chunk: int = 1024, with_entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """``(logp [N], entropy [N] or None)`` of ``targets`` ``[N]`` under ``head(hidden)`` for ``hidden``
    ``[N, H]``, ``chunk`` tokens at a time. Under autograd each chunk is checkpointed (its logits are
    recomputed in backward instead of stored)."""
    grad = torch.is_grad_enabled() and hidden.requires_grad
    logps, ents = [], []
    for i in range(0, hidden.shape[0], chunk):
        args = (head, hidden[i: i + chunk], targets[i: i + chunk], temperature, with_entropy)
        lp, ent = checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents) if with_entropy else None


def naive_token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """The reference: full fp32 log-softmax of ``logits`` ``[N, V]``, its gather and its entropy."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)
