"""A step's scored groups, for every loop that samples (RL, online DPO, RFT): generate G samples per prompt on the
rollout engines, score them on the reward actors, and stop the run when too many reward calls fail."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import torch

from learner.batch import TrainBatch, build_batch
from orchestrator.config import FleetConfig
from orchestrator.rl.episode_metrics import drop_errored_groups, episode_return
from orchestrator.telemetry.metrics import PhaseTimer
from rewards.tasks import Task
from workers.records import Collected, ScoredSample


class Sampling(Protocol):
    """What sampling reads of its run (:class:`orchestrator.rl.driver.Run` is one): the config, the task, the fleet's
    engines and reward actors, the policy version, where the run writes, and where it resumed."""

    cfg: FleetConfig
    task: Task
    run_dir: Path
    judge: Any
    version: int
    start_step: int

    @property
    def fleet(self) -> Any: ...


class RewardsFailing(RuntimeError):
    """Too many of a step's reward-function calls failed (``reward.max_error_frac``)."""


def collect(run: Sampling, step: int, timer: PhaseTimer) -> Collected:
    """Generate and score ``step``'s groups. With ``rollout.dynamic_sampling`` (DAPO), groups whose rewards are all
    equal (zero advantage) are set aside and more prompts are sampled, up to ``rollout.max_sampling_rounds``
    rounds; a batch still short is topped up with set-aside groups."""
    cfg, fleet, G = run.cfg, run.fleet, run.cfg.rollout.group_size
    need, kept, spare, errors, rounds, judge_errors = cfg.data.prompts_per_step, [], [], 0, 0, 0
    timeouts = fleet.rewards.timeouts
    while len(kept) < need and rounds < (cfg.rollout.max_sampling_rounds if cfg.rollout.dynamic_sampling else 1):
        prompts = run.task.train_batch(step, need, round_=rounds)
        with timer("generate"):
            samples = fleet.rollouts.generate(prompts, G, cfg.rollout.temperature,
                                              seed=cfg.rollout.seed * 100_003 + step + 7919 * rounds)
        with timer("reward"):
            scored, errs, judge_errs = fleet.rewards.score_judged(samples, prompts)
        errors += errs
        judge_errors += judge_errs
        rounds += 1
        for g in range(len(prompts)):
            group = scored[g * G: (g + 1) * G]
            informative = not cfg.rollout.dynamic_sampling or len({x.reward for x in group}) > 1
            (kept if informative else spare).append(group)
    groups = (kept + spare)[:need]
    calls = reward_calls(cfg, rounds * need * G)
    timed_out = fleet.rewards.timeouts - timeouts
    info = {"sampling/rounds": rounds, "sampling/informative_groups": len(kept),
            "reward/error_frac": (errors + timed_out) / calls, "reward/timeouts": timed_out,
            **({"reward/judge_errors": judge_errors} if run.judge else {})}
    if cfg.env.multi_turn:
        info["env/dropped_groups"] = drop_errored_groups(groups) if cfg.env.errored == "drop_group" else 0
    out = Collected([x for grp in groups for x in grp], errors, info, fleet.rewards.first_error)
    check_reward_errors(run, step, out)
    return out


def sample_ages(scored: list[ScoredSample], version: int) -> dict:
    """The policy versions that drew a batch, as the learner at ``version`` trains on it: ``rollout/policy_version_min``
    and ``rollout/staleness_max`` (how many versions the oldest sample lags; 1 in one_step_off)."""
    oldest = min(x.sample.policy_version for x in scored)
    return {"rollout/policy_version_min": oldest, "rollout/staleness_max": version - oldest}


def mask_invalid_rewards(scored: list[ScoredSample]) -> int:
    """The last guard before the advantages: a sample whose reward, a reward component or an episode's turn reward
    is not finite is masked out of the update (loss mask 0); its reward becomes its group's mean valid return and its
    other parts 0, so it moves no baseline and no NaN reaches the loss. Returns how many (``reward/invalid_samples``).
    Every entry refuses such values first (reward functions and models: errors scored 0; environments: env_error;
    agents: a 400), so this stays 0 unless a path is missed."""
    groups: dict[str, list[ScoredSample]] = {}
    for x in scored:
        groups.setdefault(x.sample.prompt_uid, []).append(x)
    invalid = 0
    for group in groups.values():
        valid = [episode_return(x) for x in group if _finite(x)]
        for x in (x for x in group if not _finite(x)):
            x.reward = sum(valid) / len(valid) if valid else 0.0
            x.components = {k: v if math.isfinite(v) else 0.0 for k, v in x.components.items()}
            if x.sample.episode is not None:
                x.sample.episode.turn_rewards = [0.0] * len(x.sample.episode.turn_rewards)
            x.sample.loss_mask = [0] * len(x.sample.completion_ids)
            invalid += 1
    return invalid


def _finite(x: ScoredSample) -> bool:
    return math.isfinite(episode_return(x)) and all(math.isfinite(v) for v in x.components.values()) and (
        x.sample.episode is None or all(math.isfinite(r) for r in x.sample.episode.turn_rewards))


def reward_calls(cfg, samples: int) -> int:
    """The reward-function calls that scoring ``samples`` samples makes (the judge is counted apart; a sample is
    scored at least once)."""
    return samples * max(1, len(cfg.reward.functions) - bool(cfg.judge_spec))


def check_reward_errors(run: Sampling, step: int, batch: Collected) -> None:
    """More than ``reward.max_error_frac`` of a step's reward-function calls failing stops the run with the first
    failure, before any update on the zeros they scored."""
    limit, frac = run.cfg.reward.max_error_frac, batch.info["reward/error_frac"]
    if frac > limit:
        raise RewardsFailing(f"step {step}: {frac:.0%} of the reward-function calls failed (reward.max_error_frac="
                             f"{limit}); first: {batch.first_error} (tracebacks in {run.run_dir / 'logs'}/"
                             "reward-*.log)")


def samples_to_batch(samples: list, pad_id: int, mask_truncated: bool = False) -> TrainBatch:
    """Samples in the learner's layout, padded with the tokenizer's ``pad_id`` (masks, not the pad id, say what is
    real). ``mask_truncated``: a completion cut at the length cap (finish reason ``length``) gets no loss; it
    still counts as a sequence in the loss's per-sequence normalizers and its reward in its group's baseline."""
    batch = build_batch([x.prompt_ids for x in samples], [x.completion_ids for x in samples],
                        [x.logprobs for x in samples], pad_id, [x.loss_mask for x in samples])
    if mask_truncated:
        batch.response_mask[torch.tensor([x.finish_reason == "length" for x in samples])] = 0.0
    return batch
