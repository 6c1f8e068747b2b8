"""Losses: pure torch functions, each returning ``(loss, metrics)``; registered by name in :data:`LOSSES`.

Shapes: ``b`` sequences in a micro-batch, ``T`` response tokens; ``mask`` ``[b, T]`` is 1 on response tokens.

Split invariance: every aggregate divides by *global* counts of the whole minibatch (all micro-batches and
ranks), carried in :class:`LossScale`. So a micro-batch's loss is its additive share of the minibatch loss,
and the sum over micro-batches and ranks equals the loss of the unsplit batch. Metrics are additive shares
the same way (sum them over micro-batches and ranks to get the minibatch value).

Imports only torch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from common.registry import Registry

LOSSES = Registry("loss")
register_loss = LOSSES.register
KLKind = Literal["k1", "k2", "k3"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]



@dataclass(frozen=True)
class LossScale:
    """Global counts of the minibatch a micro-batch belongs to (across all micro-batches and ranks)."""

    num_seqs: int  # sequences in the minibatch
    num_tokens: int  # valid response tokens in the minibatch
    max_len: int  # T, the generation budget (for seq_mean_token_sum_norm, Dr. GRPO)


def aggregate(values: Tensor, mask: Tensor, mode: Aggregation, scale: LossScale) -> Tensor:
    """This micro-batch's share of the minibatch aggregate of per-token ``values`` ``[b, T]``.

    - ``token_mean``: sum over all valid tokens / total valid tokens (DAPO token-level);
    - ``seq_mean_token_mean``: mean over sequences of each sequence's token mean (the GRPO paper);
    - ``seq_mean_token_sum``: mean over sequences of each sequence's token sum;
    - ``seq_mean_token_sum_norm``: token sum / (num_seqs * max_len) (Dr. GRPO's constant normalizer).
    """
    m = mask.to(values.dtype)
    masked = values * m
    if mode == "token_mean":
        return masked.sum() / max(scale.num_tokens, 1)
    if mode == "seq_mean_token_mean":
        return (masked.sum(-1) / m.sum(-1).clamp(min=1)).sum() / max(scale.num_seqs, 1)
    if mode == "seq_mean_token_sum":
        return masked.sum() / max(scale.num_seqs, 1)
    if mode == "seq_mean_token_sum_norm":
        return masked.sum() / max(scale.num_seqs * scale.max_len, 1)
    raise KeyError(f"unknown loss aggregation {mode!r}; valid: {list(Aggregation.__args__)}")


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: KLKind) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman, "Approximating KL").

    With ``log_r = ref_logp - logp`` (r = pi_ref / pi_theta):
    ``k1 = -log_r`` (= log pi_theta - log pi_ref, unbiased, high variance), ``k2 = (log_r)^2 / 2`` (biased, low
    variance), ``k3 = r - log_r - 1`` (unbiased, always >= 0; Schulman 2020, used by GRPO). ``log_r`` is clamped to
    [-20, 20] before exponentiation for numerical safety.
    """
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        log_r = log_r.clamp(-20.0, 20.0)
        return log_r.exp() - log_r - 1.0
    raise KeyError(f"unknown KL estimator {kind!r}; valid: ['k1', 'k2', 'k3']")


def _ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """Importance ratio pi_theta / pi_old per token; ``level="sequence"`` is GSPO's length-normalized sequence
    ratio ``s_i = exp(mean_t log(pi_theta / pi_old))`` with the token-level gradient form of the GSPO paper."""
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio.clamp(-20.0, 20.0).exp()
    m = mask.to(logp.dtype)
    seq = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)
    return (seq.detach()[:, None] + logp - logp.detach()).clamp(-20.0, 20.0).exp()


# a registered loss's settings are keyword arguments (the algorithm config's, learner.algorithms.loss_kwargs)
@register_loss("policy")
def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, scale: LossScale, *,  # noqa: PLR0913
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                ratio_level: str = "token", aggregation: Aggregation = "token_mean",
                ref_logp: Tensor | None = None, kl_coef: float = 0.0, kl_kind: KLKind = "k3",
                entropy: Tensor | None = None, entropy_coef: float = 0.0,
                rollout_logp: Tensor | None = None, tis_cap: float | None = None) -> tuple[Tensor, dict]:
    """PPO clipped surrogate (Schulman et al. 2017: ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``) per token, with
    optional dual clip (for A < 0 the loss is capped at ``-dual_clip * A``, Ye et al. 2020), optional
    truncated importance sampling against the rollout engine's logprobs (weight
    ``min(pi_old / pi_rollout, tis_cap)``), plus ``kl_coef * KL`` to the reference and ``- entropy_coef * H``.
    Returns the micro-batch's share of the aggregate loss and additive metrics."""
    ratio = _ratio(logp, old_logp, mask, ratio_level)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).to(logp.dtype)
    if dual_clip is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * dual_clip), pg)
    tok = LossScale(scale.num_seqs, scale.num_tokens, scale.max_len)
    metrics = {}
    if rollout_logp is not None and tis_cap is not None:
        r = (old_logp - rollout_logp).clamp(max=20.0).exp().detach()
        pg = pg * r.clamp(max=tis_cap)
        metrics["actor/tis_capped_frac"] = aggregate((r > tis_cap).to(logp.dtype), mask, "token_mean", tok)
    loss = aggregate(pg, mask, aggregation, scale)
    metrics.update({
        "actor/pg_loss": loss.detach(),
        "actor/clip_frac": aggregate(clipped, mask, "token_mean", tok),
        "actor/ratio_mean": aggregate(ratio.detach(), mask, "token_mean", tok),
    })
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, kl_kind)
        metrics["actor/kl"] = aggregate(kl.detach(), mask, "token_mean", tok)
        if kl_coef:
            loss = loss + kl_coef * aggregate(kl, mask, aggregation, scale)
    if entropy is not None:
        metrics["actor/entropy"] = aggregate(entropy.detach(), mask, "token_mean", tok)
        if entropy_coef:
            loss = loss - entropy_coef * aggregate(entropy, mask, aggregation, scale)
    metrics["actor/loss"] = loss.detach()
    return loss, metrics


@register_loss("value")
def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, scale: LossScale, *,
               clip: float | None = 0.2, aggregation: Aggregation = "token_mean") -> tuple[Tensor, dict]:
    """Clipped value loss (PPO2): ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``."""
    err = (values - returns) ** 2
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        clipped = (err_clip > err).to(values.dtype)
        err = torch.maximum(err, err_clip)
    else:
        clipped = torch.zeros_like(err)
    loss = 0.5 * aggregate(err, mask, aggregation, scale)
    tok = LossScale(scale.num_seqs, scale.num_tokens, scale.max_len)
    return loss, {"critic/value_loss": loss.detach(), "critic/clip_frac": aggregate(clipped, mask, "token_mean", tok)}


@register_loss("sft")
def sft_loss(logp: Tensor, mask: Tensor, scale: LossScale) -> tuple[Tensor, dict]:
    """Negative log-likelihood of the response tokens, token mean over the minibatch (only tokens with mask 1:
    the assistant's, never the prompt's, system's or user's)."""
    loss = aggregate(-logp, mask, "token_mean", scale)
    return loss, {"sft/nll": loss.detach(), "actor/loss": loss.detach()}


@register_loss("dpo")
def dpo_loss(logp: Tensor, ref_logp: Tensor, mask: Tensor, scale: LossScale, targets: Tensor | None = None, *,
             beta: float = 0.1, label_smoothing: float = 0.0) -> tuple[Tensor, dict]:
    """DPO (Rafailov et al. 2023) on preference pairs laid out as consecutive rows: row ``2k`` the chosen response,
    row ``2k + 1`` the rejected one, of the same prompt. With sequence logprobs ``c, r`` (policy) and ``c0, r0``
    (reference), the margin is ``z = beta * ((c - c0) - (r - r0))`` and the loss
    ``-q * log sigmoid(z) - (1 - q) * log sigmoid(-z)``, averaged over the minibatch's pairs
    (``scale.num_seqs / 2``), where ``q`` is the probability that the chosen row is preferred: 1 for a hard label,
    the pair's soft label ``p`` from ``targets`` (its value on the chosen row's tokens: an AI judge's preference
    probability, Constitutional AI), and with label smoothing ``ls`` (cDPO) ``q = p (1 - ls) + (1 - p) ls``.
    A pair with an empty row (a filler) adds nothing."""
    if logp.shape[0] % 2:
        raise ValueError(f"dpo_loss needs (chosen, rejected) row pairs, got {logp.shape[0]} rows")
    m = mask.to(logp.dtype)
    seq, ref = (logp * m).sum(-1).view(-1, 2), (ref_logp * m).sum(-1).view(-1, 2)
    real = (m.sum(-1) > 0).view(-1, 2).all(-1).to(logp.dtype)
    chosen_reward, rejected_reward = beta * (seq[:, 0] - ref[:, 0]), beta * (seq[:, 1] - ref[:, 1])
    z = chosen_reward - rejected_reward
    p = torch.ones_like(z) if targets is None else \
        ((targets * m).sum(-1) / m.sum(-1).clamp(min=1.0)).view(-1, 2)[:, 0].to(logp.dtype)
    q = p * (1.0 - label_smoothing) + (1.0 - p) * label_smoothing
    per_pair = -q * torch.nn.functional.logsigmoid(z) - (1.0 - q) * torch.nn.functional.logsigmoid(-z)
    pairs = max(scale.num_seqs // 2, 1)

    def share(v: Tensor) -> Tensor:
        return (v.detach() * real).sum() / pairs

    loss = (per_pair * real).sum() / pairs
    return loss, {"dpo/loss": loss.detach(), "dpo/reward_margin": share(z),
                  "dpo/preference_accuracy": share((z > 0).to(logp.dtype)),
                  "dpo/chosen_reward": share(chosen_reward), "dpo/rejected_reward": share(rejected_reward),
                  "dpo/chosen_logp": share(seq[:, 0]), "dpo/rejected_logp": share(seq[:, 1]),
                  "actor/loss": loss.detach()}


@register_loss("prm")
def prm_loss(logp: Tensor, targets: Tensor, mask: Tensor, scale: LossScale) -> tuple[Tensor, dict]:
    """Process reward model (Math-Shepherd layout, :mod:`rewards.prm`): at every tag position (mask 1) the
    probability of the tag, ``p = exp(logp)``, is the step's score; binary cross-entropy against the step label
    ``targets`` in [0, 1] (soft: the Monte-Carlo success rate; hard: 0/1), token mean over the minibatch's tags.
    ``log(1 - p)`` is computed as ``log(-expm1(logp))`` for accuracy when p is close to 1."""
    logp = logp.clamp(max=-1e-6)
    bce = -(targets * logp + (1.0 - targets) * torch.log(-torch.expm1(logp)))
    loss = aggregate(bce, mask, "token_mean", scale)
    hit = ((logp.exp() > 0.5) == (targets > 0.5)).to(logp.dtype)
    return loss, {"prm/bce": loss.detach(), "prm/accuracy": aggregate(hit, mask, "token_mean", scale),
                  "actor/loss": loss.detach()}


def tag_log_odds(logp: Tensor) -> Tensor:
    """``log p - log(1 - p)`` from ``logp = log p`` (a tag's score in the outcome layout), accurate for p near 1."""
    lp = logp.clamp(max=-1e-6)
    return lp - torch.log(-torch.expm1(lp))


@register_loss("bradley_terry")
def bradley_terry_loss(logp: Tensor, mask: Tensor, scale: LossScale,
                       targets: Tensor | None = None) -> tuple[Tensor, dict]:
    """Bradley-Terry preference (reward) model on (chosen, rejected) row pairs laid out as DPO's: row ``2k`` the
    chosen response, row ``2k + 1`` the rejected one. A response's score is the log-odds of the tag probability at
    its one masked position (the outcome layout of :mod:`rewards.prm`: ``p = exp(logp)``,
    ``r = log p - log(1 - p)``, so the served ``p`` is ``sigmoid(r)``). With ``z = r_chosen - r_rejected`` the
    loss is ``-q * log sigmoid(z) - (1 - q) * log sigmoid(-z)`` averaged over the minibatch's pairs, ``q`` the
    pair's soft label from ``targets`` (its value at the chosen row's tag; 1 without targets). A pair with an
    empty row (a filler) adds nothing."""
    if logp.shape[0] % 2:
        raise ValueError(f"bradley_terry_loss needs (chosen, rejected) row pairs, got {logp.shape[0]} rows")
    m = mask.to(logp.dtype)
    score = (tag_log_odds(logp) * m).sum(-1).view(-1, 2)
    real = (m.sum(-1) > 0).view(-1, 2).all(-1).to(logp.dtype)
    z = score[:, 0] - score[:, 1]
    q = torch.ones_like(z) if targets is None else \
        ((targets * m).sum(-1) / m.sum(-1).clamp(min=1.0)).view(-1, 2)[:, 0].to(logp.dtype)
    per_pair = -q * torch.nn.functional.logsigmoid(z) - (1.0 - q) * torch.nn.functional.logsigmoid(-z)
    pairs = max(scale.num_seqs // 2, 1)
    loss = (per_pair * real).sum() / pairs
    return loss, {"rm/loss": loss.detach(), "rm/accuracy": ((z > 0).to(logp.dtype) * real).sum().detach() / pairs,
                  "rm/margin": (z.detach() * real).sum() / pairs, "actor/loss": loss.detach()}


BATCH_INPUTS = frozenset({"logp", "mask", "scale", "old_logp", "advantages", "ref_logp", "entropy", "rollout_logp",
                          "targets"})
"""What the learner can hand a loss from a micro-batch; a loss's other parameters are its settings."""


def loss_inputs(name: str) -> frozenset[str]:
    """The micro-batch inputs the registered loss ``name`` reads: the learner computes entropy, fills the old
    logprobs from its first pass, or measures the engine gap only for a loss that reads them."""
    return BATCH_INPUTS & frozenset(inspect.signature(LOSSES.get_or_raise(name)).parameters)


def call_loss(name: str, inputs: dict, settings: dict) -> tuple[Tensor, dict]:
    """Run the registered loss ``name`` on the micro-batch ``inputs`` its signature names (``logp``, ``mask``,
    ``scale``, ``old_logp``, ``advantages``, ``ref_logp``, ``entropy``, ``rollout_logp``, ``targets``) and its
    ``settings``.
    A required input the batch lacks (None) is an error naming it."""
    fn = LOSSES.get_or_raise(name)
    params = inspect.signature(fn).parameters
    missing = [k for k, p in params.items() if p.default is p.empty and p.kind != p.KEYWORD_ONLY
               and inputs.get(k) is None]
    if missing:
        raise ValueError(f"loss {name!r} needs {missing}, which this batch does not carry")
    return fn(**{k: v for k, v in inputs.items() if k in params}, **settings)
