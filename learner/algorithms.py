"""Each algorithm's behaviour, registered once by its config name: how its per-token advantages (and returns, for
critic methods) are assembled from a scored batch, and which loss settings the learner gets.

One signature for every algorithm: ``fn(cfg, x: AdvantageInputs) -> (advantages [B, T], returns [B, T] | None)``,
where ``cfg`` is the algorithm's config section (plain data: :mod:`orchestrator.config.algorithm_sections`) and
``x`` what the driver knows about the batch (:func:`advantage_inputs`). The estimators themselves are the pure
functions of :mod:`learner.advantages`. ``tests/test_algorithms.py`` checks that every config section has exactly
one function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from common.registry import Registry
from learner.advantages import AdvantageInputs, conditioned_rewards, get_estimator
from learner.losses import kl_estimate

ALGORITHMS = Registry("algorithm")
"""``algorithm.name`` -> its advantage assembly."""
register_algorithm = ALGORITHMS.register

POLICY_LOSS_KEYS = ("clip_low", "clip_high", "dual_clip", "ratio_level", "aggregation", "kl_coef", "kl_kind",
                    "entropy_coef", "tis_cap")


def assemble_advantages(cfg, x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    """Per-token ``(advantages, returns)`` of the algorithm ``cfg`` selects."""
    fn: Callable = ALGORITHMS.get_or_raise(cfg.name)
    return fn(cfg, x)


OBJECTIVE_KEYS = {"policy": POLICY_LOSS_KEYS, "sft": (), "dpo": ("beta", "label_smoothing"), "prm": (),
                  "bradley_terry": ()}
"""Each learner objective's settings, read from the algorithm section."""


def loss_kwargs(cfg) -> dict:
    """The learner's objective (a registered loss) and its keyword arguments (the learner sees only these)."""
    return {"objective": cfg.objective, **{k: getattr(cfg, k) for k in OBJECTIVE_KEYS[cfg.objective]}}


def preference_pairs(rewards: Sequence[float], prompt_uids: Sequence[str], min_gap: float) -> list[tuple[int, int]]:
    """Online DPO: per prompt group (in order of first appearance), the (best, worst) sample indices by reward when
    the rewards differ by at least ``min_gap``; ties go to the earlier sample."""
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(prompt_uids):
        groups.setdefault(uid, []).append(i)
    pairs = []
    for rows in groups.values():
        best = max(rows, key=lambda i: (rewards[i], -i))
        worst = min(rows, key=lambda i: (rewards[i], i))
        if rewards[best] - rewards[worst] >= min_gap and best != worst:
            pairs.append((best, worst))
    return pairs


def critic_loss_kwargs(cfg) -> dict:
    """Keyword arguments of :func:`learner.losses.value_loss` (critic methods)."""
    return {"clip": cfg.value_clip, "aggregation": cfg.aggregation}


def advantage_inputs(rewards: Sequence[float], components: Sequence[dict[str, float]], prompt_uids: Sequence[str],
                     mask: Tensor, values: Tensor | None = None, old_logprobs: Tensor | None = None,
                     ref_logprobs: Tensor | None = None, steps: tuple[Tensor, Tensor] | None = None,
                     turns: Sequence[tuple[list[int], list[float]]] | None = None) -> AdvantageInputs:
    """The driver's view of a scored batch: summed rewards, the named components (sorted by name; a component a
    sample lacks is 0), one group id per distinct prompt uid (in order of first appearance). ``turns``: for
    multi-turn episodes, each sample's (turn end indices, turn rewards); the rewards become part of the episode's
    return (``rewards`` += their sum) and sit on their turns' last tokens for token-level estimators."""
    names = sorted({k for c in components for k in c})
    index: dict[str, int] = {}
    turn_rewards = None
    if turns is not None:
        turn_rewards = torch.zeros_like(mask, dtype=torch.float32)
        for i, (ends, per_turn) in enumerate(turns):
            for end, value in zip(ends, per_turn):
                turn_rewards[i, end] += value
        rewards = [r + float(t.sum()) for r, t in zip(rewards, turn_rewards)]
    return AdvantageInputs(
        rewards=torch.tensor(list(rewards), dtype=torch.float32), turn_rewards=turn_rewards,
        components=torch.tensor([[c.get(n, 0.0) for n in names] for c in components], dtype=torch.float32),
        component_names=names, group_ids=torch.tensor([index.setdefault(u, len(index)) for u in prompt_uids]),
        mask=mask, values=values, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
        step_rewards=steps[0] if steps else None, step_ends=steps[1] if steps else None,
    )


@register_algorithm("grpo")
def grpo(cfg, x: AdvantageInputs) -> tuple[Tensor, None]:
    return get_estimator("grpo")(x.rewards, x.group_ids, x.mask, scale_by_std=cfg.scale_by_std, eps=cfg.eps), None


@register_algorithm("dr_grpo")
def dr_grpo(cfg, x: AdvantageInputs) -> tuple[Tensor, None]:
    return get_estimator("dr_grpo")(x.rewards, x.group_ids, x.mask), None


@register_algorithm("rloo")
def rloo(cfg, x: AdvantageInputs) -> tuple[Tensor, None]:
    return get_estimator("rloo")(x.rewards, x.group_ids, x.mask), None


@register_algorithm("reinforce_pp")
def reinforce_pp(cfg, x: AdvantageInputs) -> tuple[Tensor, None]:
    return get_estimator("reinforce_pp")(x.outcome_token_rewards(), x.mask, gamma=cfg.gamma)[0], None


@register_algorithm("reinforce_pp_baseline")
def reinforce_pp_baseline(cfg, x: AdvantageInputs) -> tuple[Tensor, None]:
    return get_estimator("reinforce_pp_baseline")(x.rewards, x.group_ids, x.mask), None


@register_algorithm("gdpo")
def gdpo(cfg, x: AdvantageInputs) -> tuple[Tensor, None]:
    """Components by name: ``cfg.weights`` and ``cfg.conditions`` name reward components; an unknown name is an
    error listing the batch's components."""
    idx = {n: i for i, n in enumerate(x.component_names)}
    named = [c.reward for c in cfg.conditions] + [c.if_reward for c in cfg.conditions] + list(cfg.weights or {})
    for name in named:
        if name not in idx:
            raise KeyError(f"algorithm (gdpo): unknown reward component {name!r}; have {x.component_names}")
    rules = [(idx[c.reward], idx[c.if_reward], c.threshold) for c in cfg.conditions]
    comps = conditioned_rewards(x.components, rules)
    w = torch.tensor([(cfg.weights or {}).get(n, 1.0) for n in x.component_names], dtype=comps.dtype)
    return get_estimator("gdpo")(comps, x.group_ids, x.mask, weights=w, eps=cfg.eps), None


@register_algorithm("grpo_process")
def grpo_process(cfg, x: AdvantageInputs) -> tuple[Tensor, None]:
    return get_estimator("grpo_process")(x.step_rewards, x.step_ends, x.group_ids, x.mask, eps=cfg.eps), None


@register_algorithm("on_policy_distill")
def on_policy_distill(cfg, x: AdvantageInputs) -> tuple[Tensor, None]:
    """The teacher's per-token reverse KL to the student's sampled tokens, plus ``reward_weight`` times the task
    reward's GRPO advantage."""
    assert x.teacher_logprobs is not None and x.rollout_logprobs is not None, "distillation needs both logprobs"
    adv = get_estimator("reverse_kl")(x.teacher_logprobs, x.rollout_logprobs, x.mask)
    if cfg.reward_weight:
        grpo = get_estimator("grpo")(x.rewards, x.group_ids, x.mask, scale_by_std=cfg.scale_by_std, eps=cfg.eps)
        adv = adv + cfg.reward_weight * grpo
    return adv, None


@register_algorithm("ppo")
def ppo(cfg, x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Per-token rewards: the outcome reward on the last response token (plus, with a PRM, each step's score on the
    step's last token), minus ``kl_reward_coef`` times the k1 KL
    of the policy to the reference on every response token; then GAE against the critic's values."""
    rewards = x.outcome_token_rewards()
    if x.step_rewards is not None:  # a PRM's step scores (process supervision), each on its step's last token
        assert x.step_ends is not None, "step rewards come with their step ends"
        rewards = rewards + step_token_rewards(x.step_rewards, x.step_ends, x.mask)
    if cfg.kl_reward_coef:
        assert x.old_logprobs is not None and x.ref_logprobs is not None, "PPO's KL reward needs both logprobs"
        rewards = rewards - cfg.kl_reward_coef * kl_estimate(x.old_logprobs, x.ref_logprobs, "k1") * x.mask
    return get_estimator("gae")(rewards, x.values, x.mask, cfg.gamma, cfg.lam, whiten=cfg.whiten_advantages)


def step_token_rewards(step_rewards: Tensor, step_ends: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]`` rewards with each present step's reward on the token that ends it (``step_ends`` -1: absent)."""
    out = torch.zeros_like(mask, dtype=step_rewards.dtype)
    present = step_ends >= 0
    rows = torch.arange(step_rewards.shape[0])[:, None].expand_as(step_ends)
    out.index_put_((rows[present], step_ends[present]), step_rewards[present], accumulate=True)
    return out * mask.to(out.dtype)
