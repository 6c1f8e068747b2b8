"""The `algorithm` config sections: one pydantic class per algorithm, chosen once at load time by the discriminated
union on ``name``. Plain data (no torch): each algorithm's behaviour, its advantage assembly and the loss settings
the learner gets, is one function in :mod:`learner.algorithms`, registered under the same name."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from orchestrator.config.section import Section


class LossConfig(Section):
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO ratio clip below 1 (eps_low)."""
    clip_high: float = Field(0.2, ge=0.0, le=10.0)
    """PPO ratio clip above 1 (eps_high; > clip_low is DAPO's clip-higher)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """beta: weight of the KL(pi_theta || pi_ref) penalty in the loss."""
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman): k1 = log r, k2 = (log r)^2 / 2, k3 = r - log r - 1 with r = pi_ref / pi_theta."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus weight (subtracted from the loss)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = (
        "token_mean"
    )
    """How per-token losses become one number; the result does not depend on micro-batch or rank splits."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual-clip constant c > 1: for negative advantages the loss is capped at -c * A (None disables)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (PPO/GRPO) or per sequence (GSPO)."""
    tis_cap: float | None = Field(2.0, gt=0.0)
    """Truncated importance sampling: weight tokens by min(pi_old / pi_rollout, tis_cap) to correct for the
    rollout engine's numerics or staleness (None disables)."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: completions cut at `rollout.max_new_tokens` (finish reason `length`) get no
    loss (their rewards still count in their group's baseline)."""
    rejection: Literal["none", "token", "geometric"] = "none"
    """Off-policy rejection (`learner.corrections`), with r = pi_old / pi_rollout per token: `token` drops the
    tokens whose r is outside `rejection_band` (masked IS; with `tis_cap` = the band's top, IcePop), `geometric`
    drops the sequences whose geometric-mean r is outside it (sequence masking). Dropped tokens leave the loss's
    denominator too. Needs the learner's logprobs before the update: a rejection adds that pass."""
    rejection_band: tuple[float, float] = (0.5, 2.0)
    """[low, high] around 1 that `rejection` keeps."""

    @field_validator("rejection_band")
    @classmethod
    def _band_around_one(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 <= v[0] < 1.0 < v[1]:
            raise ValueError(f"rejection_band must be [low, high] with 0 <= low < 1 < high, got {list(v)}")
        return v

    uses_critic: ClassVar[bool] = False
    uses_step_rewards: ClassVar[bool] = False
    uses_teacher: ClassVar[bool] = False
    """The teacher's engines (`distill.teacher`, `teacher-i` actors) score every sampled token."""
    objective: ClassVar[str] = "policy"
    """The registered learner loss (`learner.losses.LOSSES`) this algorithm trains with."""
    sampling_temperature_logprobs: ClassVar[bool] = True
    """The learner's logprobs divide the logits by `rollout.temperature` (the ratio to the sampling policy needs
    them); the objectives below (SFT, DPO, PRM) score the model itself, at temperature 1."""

    def needs_reference(self) -> bool:
        """Whether a loss or reward term reads the frozen reference policy's logprobs."""
        return self.kl_coef > 0

    def accepts_stale_samples(self) -> bool:
        """Whether samples of an older policy may be trained on (one_step_off, async): the ratio to the sampling
        policy needs its truncated-IS correction."""
        return self.tis_cap is not None


class GRPOConfig(LossConfig):
    """GRPO (DeepSeekMath): group-normalized outcome reward as every token's advantage."""

    name: Literal["grpo"] = "grpo"
    """Selects this algorithm: `algorithm.name: grpo`."""
    scale_by_std: bool = True
    """Divide by the group's (unbiased) std; False is Dr. GRPO."""
    eps: float = Field(1e-6, gt=0.0)
    """Added to the std in the denominator."""


class DrGRPOConfig(LossConfig):
    """Dr. GRPO: GRPO without the std division (and usually seq_mean_token_sum_norm aggregation)."""

    name: Literal["dr_grpo"] = "dr_grpo"
    """Selects this algorithm: `algorithm.name: dr_grpo`."""


class RLOOConfig(LossConfig):
    """RLOO: reward minus the mean reward of the other members of the group."""

    name: Literal["rloo"] = "rloo"
    """Selects this algorithm: `algorithm.name: rloo`."""


class ReinforcePPConfig(LossConfig):
    """REINFORCE++: discounted return-to-go of the outcome reward (on the last token), whitened over the batch."""

    name: Literal["reinforce_pp"] = "reinforce_pp"
    """Selects this algorithm: `algorithm.name: reinforce_pp`."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount of the return-to-go."""


class ReinforcePPBaselineConfig(LossConfig):
    """REINFORCE++-baseline: group mean subtracted, then whitened over the batch."""

    name: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"
    """Selects this algorithm: `algorithm.name: reinforce_pp_baseline`."""


class RewardCondition(Section):
    reward: str
    """Component that is conditioned (zeroed unless the condition holds)."""
    if_reward: str
    """Component the condition reads."""
    threshold: float = 1.0
    """`reward` counts only when `if_reward` >= threshold."""


class GDPOConfig(LossConfig):
    """GDPO: each reward component normalized within its group, weighted sum, then batch-normalized."""

    name: Literal["gdpo"] = "gdpo"
    """Selects this algorithm: `algorithm.name: gdpo`."""
    weights: dict[str, float] | None = None
    """Weight per component name (default 1 each)."""
    conditions: list[RewardCondition] = Field(default_factory=list)
    """Conditioned rewards (GDPO): a component counts only when another reaches a threshold."""
    eps: float = Field(1e-6, gt=0.0)
    """Added to the std in both normalizations."""


class GRPOProcessConfig(LossConfig):
    """Process-supervised GRPO (DeepSeekMath): each completion is cut into steps, every step is scored by the
    reward functions on the completion prefix that ends there, step rewards are normalized per group, and a
    token's advantage is the sum of the normalized rewards of the steps ending at or after it."""

    name: Literal["grpo_process"] = "grpo_process"
    """Selects this algorithm: `algorithm.name: grpo_process`."""
    uses_step_rewards: ClassVar[bool] = True
    step_separator: str | None = None
    """A step ends at each token whose text contains this string (and at the last token); "" makes every token a
    step; None: `data.step_separator` (the task's: `;` for `chain`, else a newline)."""
    eps: float = Field(1e-6, gt=0.0)
    """Added to the std in the denominator."""


class PPOConfig(LossConfig):
    """PPO with a learned critic (seeds 000/002): per-token rewards r_t - beta * KL_t with the outcome reward on the
    last token, GAE advantages and returns, a clipped value loss for the critic (its own DeepSpeed group)."""

    name: Literal["ppo"] = "ppo"
    """Selects this algorithm: `algorithm.name: ppo`."""
    uses_critic: ClassVar[bool] = True
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """GAE discount."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda."""
    kl_reward_coef: float = Field(0.0, ge=0.0)
    """beta of the per-token KL penalty folded into the reward (k1 estimator, PPO/InstructGPT style)."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over the batch's valid tokens."""
    value_clip: float | None = Field(0.2, gt=0.0)
    """Clip range of the value loss around the old values (None disables)."""
    critic_lr: float = Field(1e-4, gt=0.0, le=1.0)
    """Critic AdamW learning rate."""

    def needs_reference(self) -> bool:
        return self.kl_coef > 0 or self.kl_reward_coef > 0


class OnPolicyDistillConfig(LossConfig):
    """On-policy distillation (GKD, Agarwal et al. 2024; Thinking Machines, Oct 2025; Qwen3's small models): the
    student samples, the teacher (`distill.teacher`, served by `distill.teacher_workers` engines of its own)
    scores every sampled token, and each token's advantage is `log pi_teacher(y_t) - log pi_student(y_t)`: the
    negative per-token reverse KL, with the student's logprob as its engine sampled it (at `rollout.temperature`)
    and the teacher's at temperature 1. Teacher and student must share a tokenizer (checked at load). The update
    is the policy loss with these advantages (ratio, clipping and truncated IS as for GRPO)."""

    name: Literal["on_policy_distill"] = "on_policy_distill"
    """Selects this algorithm: `algorithm.name: on_policy_distill`."""
    uses_teacher: ClassVar[bool] = True
    reward_weight: float = Field(0.0, ge=0.0)
    """Weight of the task reward's GRPO advantage added to every token's (0: the teacher alone)."""
    scale_by_std: bool = True
    """The reward term's GRPO: divide by the group's std."""
    eps: float = Field(1e-6, gt=0.0)
    """The reward term's GRPO: added to the std in the denominator."""


class ObjectiveConfig(Section):
    """Base of the algorithms that are not policy gradients: no advantages, no ratio clipping."""

    uses_critic: ClassVar[bool] = False
    uses_step_rewards: ClassVar[bool] = False
    uses_teacher: ClassVar[bool] = False
    mask_truncated: ClassVar[bool] = False
    tis_cap: ClassVar[float | None] = None
    rejection: ClassVar[str] = "none"
    sampling_temperature_logprobs: ClassVar[bool] = False

    def accepts_stale_samples(self) -> bool:
        """Samples of an older policy train these objectives as they are: DPO compares with its frozen reference,
        RFT's SFT imitates verified samples; neither weighs a sample by the policy that drew it."""
        return True


class SFTConfig(ObjectiveConfig):
    """Supervised fine-tuning (`fleetrl sft`, the SFT of `fleetrl rft` and `fleetrl distill`): the token-mean
    negative log-likelihood of the trained tokens (the assistant's; never the prompt's, system's or user's)."""

    name: Literal["sft"] = "sft"
    """Selects this objective: `algorithm.name: sft` (set by `fleetrl sft`, `rft` and `distill`)."""
    objective: ClassVar[str] = "sft"

    def needs_reference(self) -> bool:
        return False


class DPOConfig(ObjectiveConfig):
    """DPO (Rafailov et al. 2023): a policy trained to prefer chosen over rejected responses, relative to the
    frozen reference (the stage's starting policy). Offline from `pairs`, or online from the rollout groups: each
    group's best and worst sample by reward, when their rewards differ by at least `min_reward_gap`."""

    name: Literal["dpo"] = "dpo"
    """Selects this algorithm: `algorithm.name: dpo`."""
    objective: ClassVar[str] = "dpo"
    beta: float = Field(0.1, gt=0.0, le=100.0)
    """Inverse temperature of the implicit reward beta * log(pi / pi_ref)."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    """Conservative DPO: the probability that a preference label is flipped (0: plain DPO)."""
    pairs: str | None = None
    """Offline DPO: preference rows `prompt`, `chosen`, `rejected` (strings, or chat message lists; without
    `prompt`, TRL's implicit prompt: the messages chosen and rejected share) from a file (JSONL, `.json`,
    `.parquet`, `.csv`), a dataset directory or a Hub dataset id. None: online DPO from the rollout groups."""
    min_reward_gap: float = Field(0.5, ge=0.0)
    """Online DPO: a group gives a (best, worst) pair only when their rewards differ by at least this."""

    def needs_reference(self) -> bool:
        return True


class PRMConfig(ObjectiveConfig):
    """Process reward model training (`fleetrl prm train`): binary cross-entropy of the tag probability at every
    step against the step's label (rewards/prm.py)."""

    name: Literal["prm"] = "prm"
    """Selects this objective: `algorithm.name: prm` (set by `fleetrl prm train`)."""
    objective: ClassVar[str] = "prm"

    def needs_reference(self) -> bool:
        return False


class BradleyTerryConfig(ObjectiveConfig):
    """A Bradley-Terry preference (reward) model from preference pairs (`fleetrl train` with `algorithm.name:
    reward_model`): pairwise log-sigmoid loss of the score difference, soft labels allowed. The score is the
    log-odds of a tag token after the response (the outcome-model layout of rewards/prm.py), so `final/` is an
    HF causal LM that the `orm-i` actors serve (`prm.orm_path`, e.g. search's `orm_best_of_n`)."""

    name: Literal["reward_model"] = "reward_model"
    """Selects this objective: `algorithm.name: reward_model`."""
    objective: ClassVar[str] = "bradley_terry"
    pairs: str | None = None
    """Required (a pipeline's `ai_preferences: N` stage writes it): preference rows `prompt`, `chosen`,
    `rejected` (strings or chat messages; TRL's implicit prompt too) and optional `preference` (P(chosen is
    better), a soft label), from a file, a dataset directory or a Hub dataset id, as DPO's offline pairs."""
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of the pairs (by prompt) held out for `rm/heldout_accuracy`."""

    def needs_reference(self) -> bool:
        return False


ALGORITHM_SECTIONS = (GRPOConfig, DrGRPOConfig, RLOOConfig, ReinforcePPConfig, ReinforcePPBaselineConfig, GDPOConfig,
              GRPOProcessConfig, PPOConfig, OnPolicyDistillConfig, SFTConfig, DPOConfig, PRMConfig, BradleyTerryConfig)
AlgorithmConfig = Annotated[GRPOConfig | DrGRPOConfig | RLOOConfig | ReinforcePPConfig | ReinforcePPBaselineConfig
                            | GDPOConfig | GRPOProcessConfig | PPOConfig | OnPolicyDistillConfig | SFTConfig
                            | DPOConfig | PRMConfig | BradleyTerryConfig, Field(discriminator="name")]
"""Every algorithm section (:data:`ALGORITHM_SECTIONS`, spelled out so a type checker sees the union), told apart by
``name``."""
