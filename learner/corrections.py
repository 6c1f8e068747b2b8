"""Off-policy rejection: tokens (or whole sequences) sampled by a policy too far from the learner's are dropped from
the policy loss. Pure torch functions, registered by name in :data:`REJECTIONS`.

With ``r = pi_old / pi_rollout`` per token (``pi_old``: the learner's policy before the update, the proximal policy
of a decoupled objective; ``pi_rollout``: the engine that sampled the token, older by the staleness and different
by its numerics), a rejection keeps a token when:

- ``token``: its own ``r`` lies in ``[low, high]`` (masked importance sampling; with ``algorithm.tis_cap = high``
  the kept tokens' weights are ``r`` itself, which is IcePop's objective);
- ``geometric``: its sequence's geometric-mean ratio ``exp(mean_t log r)`` lies in ``[low, high]`` (the whole
  sequence is kept or dropped: sequence masking, length-normalized so long and short sequences meet one band).

The truncated-IS weight ``min(r, tis_cap)`` of the kept tokens is the policy loss's (:func:`learner.losses.
policy_loss`). Dropped tokens leave the loss's token count too (the driver removes them from the response mask
before the global counts are taken), not only its numerator; under a per-sequence aggregation a dropped sequence
still counts as a sequence, as a truncated one does under ``algorithm.mask_truncated``. The critic (PPO) still
trains on every token.

Imports only torch.
"""

from __future__ import annotations

from torch import Tensor

from common.registry import Registry

REJECTIONS = Registry("off-policy rejection")
register_rejection = REJECTIONS.register


def _log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    return ((old_logp - rollout_logp) * mask).clamp(-20.0, 20.0)


@register_rejection("token")
def token_band(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """Keep [B, T]: the tokens whose ratio lies in ``[low, high]``."""
    r = _log_ratio(old_logp, rollout_logp, mask).exp()
    return (mask > 0) & (r >= low) & (r <= high)


@register_rejection("geometric")
def geometric_band(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """Keep [B, T]: every token of the sequences whose geometric-mean ratio lies in ``[low, high]``."""
    m = mask.to(old_logp.dtype)
    mean_log = _log_ratio(old_logp, rollout_logp, m).sum(-1) / m.sum(-1).clamp(min=1.0)
    g = mean_log.exp()
    return (mask > 0) & ((g >= low) & (g <= high))[:, None]


def mismatch_kl(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    """Token mean of the k3 estimate of KL(pi_rollout || pi_old) from the rollout's own samples
    (``r - log r - 1`` with ``r = pi_old / pi_rollout``): 0 when the engine sampled from the learner's policy."""
    m = mask.to(old_logp.dtype)
    log_r = _log_ratio(old_logp, rollout_logp, m)
    return ((log_r.exp() - log_r - 1.0).clamp(min=0.0) * m).sum() / m.sum().clamp(min=1.0)


def reject(name: str, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, low: float,
           high: float) -> tuple[Tensor, dict[str, float]]:
    """The response mask with the rejected tokens zeroed, and the ``off_policy/*`` metrics of the batch."""
    keep = REJECTIONS.get_or_raise(name)(old_logp, rollout_logp, mask, low, high)
    tokens, seqs = mask > 0, (mask > 0).any(-1)
    dropped_seqs = seqs & ~(keep & tokens).any(-1)
    metrics = {"off_policy/mismatch_kl": float(mismatch_kl(old_logp, rollout_logp, mask)),
               "off_policy/rejected_token_frac": float((tokens & ~keep).sum() / tokens.sum().clamp(min=1)),
               "off_policy/rejected_seq_frac": float(dropped_seqs.sum() / seqs.sum().clamp(min=1))}
    return mask * keep.to(mask.dtype), metrics


def logprob_gap_stats(learner_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """``{"max", "p99", "mean"}`` of ``|learner - engine|`` logprob over the ``mask``-ed tokens (all ``[B, T]``):
    how far the engine's sampling distribution is from the learner's on the tokens it sampled (zeros when no token
    is masked in). ``p99``: the 0.99 quantile (linear interpolation), the gap that a few tokens' rounding spikes do
    not set."""
    gap = (learner_logp - engine_logp).abs()[mask > 0].double()
    if not gap.numel():
        return {"max": 0.0, "p99": 0.0, "mean": 0.0}
    return {"max": float(gap.max()), "p99": float(gap.quantile(0.99)), "mean": float(gap.mean())}
