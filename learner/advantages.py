"""Advantage estimators: pure torch functions, registered by name in :data:`ADVANTAGE_ESTIMATORS`.

Shapes: ``B`` sequences, ``T`` response tokens; ``mask`` is ``[B, T]``, 1 on response tokens and 0 on padding;
``rewards`` is ``[B]`` (one outcome reward per sequence); ``group_ids`` is ``[B]`` integer ids, equal for the
G samples of one prompt. Every estimator returns per-token advantages ``[B, T]`` (zero on padding); GAE and
REINFORCE++ also return returns.

Formulas follow the seed documents (shared/seeds), see each docstring. Departures are stated there.
Imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from common.registry import Registry

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
register_estimator = ADVANTAGE_ESTIMATORS.register


def get_estimator(name: str) -> Callable:
    return ADVANTAGE_ESTIMATORS.get_or_raise(name)


@dataclass
class AdvantageInputs:
    """What the driver knows about a scored batch; each algorithm config picks what its estimator needs."""

    rewards: Tensor  # [B] summed (weighted) outcome reward
    components: Tensor  # [B, K] the named reward components, in `component_names` order
    component_names: list[str]
    group_ids: Tensor  # [B] one id per prompt
    mask: Tensor  # [B, T] response tokens
    values: Tensor | None = None  # [B, T] critic values (critic methods)
    step_rewards: Tensor | None = None  # [B, S] process rewards per step (process supervision)
    step_ends: Tensor | None = None  # [B, S] token index where each step ends, -1 for absent steps
    old_logprobs: Tensor | None = None  # [B, T] policy logprobs before the update
    ref_logprobs: Tensor | None = None  # [B, T] reference logprobs
    turn_rewards: Tensor | None = None  # [B, T] multi-turn episodes: each turn's reward on its last token
    rollout_logprobs: Tensor | None = None  # [B, T] the engine's logprobs of the sampled tokens
    teacher_logprobs: Tensor | None = None  # [B, T] a teacher's logprobs of the same tokens (on-policy distillation)

    def outcome_token_rewards(self) -> Tensor:
        """``[B, T]``: the outcome reward on each sequence's last valid token, 0 elsewhere. For multi-turn
        episodes ``rewards`` is the episode's return (outcome + every turn's reward): the turn rewards stay on
        their turns' last tokens and the rest goes on the last token."""
        m = self.mask.to(self.rewards.dtype)
        last = (m.cumsum(-1) == m.sum(-1, keepdim=True)) & (m > 0)
        if self.turn_rewards is None:
            return self.rewards[:, None] * last.to(self.rewards.dtype)
        outcome = self.rewards - self.turn_rewards.sum(-1)
        return outcome[:, None] * last.to(self.rewards.dtype) + self.turn_rewards


def _group_stats(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence group mean, unbiased group std (0 for a group of one) and group size, each ``[B]``."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    vals = values.double()
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, torch.ones_like(vals))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, vals)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, (vals - mean[inv]) ** 2)
    std = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq)).sqrt()
    return mean[inv].to(values.dtype), std[inv].to(values.dtype), count[inv]


def _broadcast(per_seq: Tensor, mask: Tensor) -> Tensor:
    return per_seq[:, None].to(mask.dtype if mask.is_floating_point() else torch.float32) * mask


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the valid tokens (biased std, as in PPO implementations); 0 on padding."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) / (var.sqrt() + eps) * m


@register_estimator("grpo")
def compute_grpo(rewards: Tensor, group_ids: Tensor, mask: Tensor, scale_by_std: bool = True,
                 eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage (DeepSeekMath, Shao et al. 2024): ``A_i = (r_i - mean_g) / (std_g + eps)`` with the
    unbiased (n-1) group std, broadcast over the sequence's valid tokens. A group of one gets 0.
    ``scale_by_std=False`` is Dr. GRPO: ``A_i = r_i - mean_g``."""
    mean, std, count = _group_stats(rewards, group_ids)
    adv = rewards - mean
    if scale_by_std:
        adv = adv / (std + eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return _broadcast(adv, mask)


@register_estimator("reverse_kl")
def compute_reverse_kl(teacher_logprobs: Tensor, student_logprobs: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation's per-token advantage: ``A_t = log pi_T(y_t) - log pi_S(y_t)`` for ``y_t`` sampled
    from the student, the negative of the per-token reverse KL estimate (its mean over samples is
    ``-KL(pi_S || pi_T)``). No discounting, no baseline: each token is judged by the teacher where it stands."""
    return (teacher_logprobs - student_logprobs) * mask


@register_estimator("dr_grpo")
def compute_dr_grpo(rewards: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025): GRPO without the std division."""
    return compute_grpo(rewards, group_ids, mask, scale_by_std=False)


@register_estimator("rloo")
def compute_rloo(rewards: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024): ``A_i = r_i - (sum_g - r_i) / (n_g - 1)``; 0 for a group of one."""
    mean, _, count = _group_stats(rewards, group_ids)
    loo = (mean * count.to(rewards.dtype) - rewards) / (count - 1).clamp(min=1).to(rewards.dtype)
    adv = torch.where(count > 1, rewards - loo, torch.zeros_like(rewards))
    return _broadcast(adv, mask)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go ``G_t = r_t + gamma * G_{t+1}`` over valid tokens, 0 beyond the last one. ``[B, T]``.
    ``t + 1`` is the next *valid* token: masked positions inside a sequence (a multi-turn episode's observations)
    are skipped, not counted as steps, so the result equals that of the sequence with them removed."""
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    valid = mask > 0
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        running = torch.where(valid[:, t], token_rewards[:, t] + gamma * running, running)
        out[:, t] = running * valid[:, t]
    return out


@register_estimator("gae")
def compute_gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float,
                whiten: bool = False) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016, computed by the usual backward loop):
    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``; V beyond the last valid
    token is 0. Returns ``(advantages, returns)`` with ``returns = advantages + values`` (before whitening).
    ``t + 1`` is the next *valid* token: masked positions inside a sequence (a multi-turn episode's observations)
    are skipped, so the result equals that of the sequence with them removed."""
    m = mask.to(values.dtype)
    valid = mask > 0
    vals = values * m
    adv = torch.zeros_like(vals)
    last = torch.zeros_like(vals[:, 0])
    next_v = torch.zeros_like(last)
    for t in range(vals.shape[1] - 1, -1, -1):
        delta = token_rewards[:, t] + gamma * next_v - vals[:, t]
        last = torch.where(valid[:, t], delta + gamma * lam * last, last)
        next_v = torch.where(valid[:, t], vals[:, t], next_v)
        adv[:, t] = last * m[:, t]
    returns = (adv + vals) * m
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns


@register_estimator("reinforce_pp")
def compute_reinforce_pp(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over the batch's valid tokens.
    Returns ``(advantages, returns)``."""
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


@register_estimator("reinforce_pp_baseline")
def compute_reinforce_pp_baseline(rewards: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean reward, then whiten over the batch's valid tokens."""
    mean, _, _ = _group_stats(rewards, group_ids)
    return masked_whiten(_broadcast(rewards - mean, mask), mask)


@register_estimator("gdpo")
def compute_gdpo(reward_components: Tensor, group_ids: Tensor, mask: Tensor, weights: Tensor | None = None,
                 eps: float = 1e-6) -> Tensor:
    """GDPO: normalize each of the K reward components within its group (as GRPO), take the
    weighted sum ``sum_k w_k A_k``, then normalize that sum over the batch's sequences:
    ``(s - mean_B) / (std_B + eps)`` (unbiased std). ``reward_components`` is ``[B, K]``."""
    B, K = reward_components.shape
    w = torch.ones(K, dtype=reward_components.dtype) if weights is None else weights.to(reward_components.dtype)
    ones = torch.ones(B, 1)
    per_k = torch.stack([compute_grpo(reward_components[:, k], group_ids, ones, eps=eps)[:, 0] for k in range(K)], 1)
    summed = (per_k * w).sum(1)
    std = summed.std(unbiased=True) if B > 1 else torch.zeros((), dtype=summed.dtype)
    normed = (summed - summed.mean()) / (std + eps)
    return _broadcast(normed, mask)


@register_estimator("grpo_process")
def compute_grpo_process(step_rewards: Tensor, step_ends: Tensor, group_ids: Tensor, mask: Tensor,
                         eps: float = 1e-6) -> Tensor:
    """Process-supervised GRPO (DeepSeekMath §4.1.3). ``step_rewards`` ``[B, S]`` and ``step_ends`` ``[B, S]``
    (token index where each step ends, -1 for an absent step). All step rewards of a group are normalized
    together, ``r~ = (r - mean_g) / (std_g + eps)`` (unbiased std over the group's steps), and token t's
    advantage is the sum of the normalized rewards of the steps ending at or after t."""
    present = step_ends >= 0
    _, inv = torch.unique(group_ids, return_inverse=True)
    normed = torch.zeros_like(step_rewards)
    for g in range(int(inv.max()) + 1):
        sel = (inv == g)[:, None] & present
        vals = step_rewards[sel]
        std = vals.std(unbiased=True) if vals.numel() > 1 else torch.zeros((), dtype=vals.dtype)
        normed[sel] = (vals - vals.mean()) / (std + eps) if vals.numel() > 1 else torch.zeros_like(vals)
    T = mask.shape[1]
    t = torch.arange(T)
    ends_after = (step_ends[:, :, None] >= t[None, None, :]) & present[:, :, None]  # [B, S, T]
    adv = (normed[:, :, None] * ends_after).sum(1)
    return adv * mask.to(adv.dtype)


def conditioned_rewards(components: Tensor, rules: list[tuple[int, int, float]]) -> Tensor:
    """Conditioned rewards (GDPO): for each rule ``(k, l, threshold)``, reward k counts only when
    reward l >= threshold; otherwise it is set to 0. ``components`` ``[B, K]``; returns a new ``[B, K]``.
    Rules see the unconditioned values (they do not chain)."""
    out = components.clone()
    for k, cond, threshold in rules:
        out[:, k] = torch.where(components[:, cond] >= threshold, components[:, k], torch.zeros_like(out[:, k]))
    return out
