"""`fleetrl rft`: rejection-sampling fine-tuning (RFT; Yuan et al. 2023, "Scaling Relationship on Learning
Mathematical Reasoning with LLMs"; the expert-iteration / STaR family).

Each round, on the same actors as `fleetrl train`:

    generate G samples for each of `data.prompts_per_step` prompts -> score -> keep the verified-correct ones
    (summed reward >= `rft.threshold`, identical completions of a prompt kept once) -> one supervised update on
    them through the DeepSpeed learner group -> push the weights to the engines

The learner stays algorithm-blind: a supervised step is ``policy_loss`` with advantage 1 on every kept token,
``old_logprobs`` from a no-grad pass of the same weights (so the ratio is exactly 1), no KL, entropy or
truncated-IS term, token-mean aggregation, one epoch, one minibatch. At ratio 1 the clipped surrogate
``-A * ratio`` has gradient ``-A * grad log pi``, i.e. exactly the token-mean NLL gradient of
``learner.losses.sft_loss`` (``tests/test_eval_rft.py`` checks this). The loop, evals, checkpoints and the
final policy are the Trainer's (:class:`RFTTrainer` replaces only the training step); one row per round goes to
``<run.dir>/rft_metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from learner.batch import TrainBatch, build_batch
from orchestrator.config import ConfigError, FleetConfig
from orchestrator.metrics import PhaseTimer
from orchestrator.trainer import Trainer, learner_metrics
from rewards.functions import is_correct
from workers.records import Sample, ScoredSample

log = logging.getLogger("fleetrl")

SFT_LOSS = {"kl_coef": 0.0, "tis_cap": None, "entropy_coef": 0.0, "aggregation": "token_mean",
            "ratio_level": "token", "dual_clip": None}
"""``policy_loss`` settings that make it the supervised NLL at ratio 1 (see the module docstring)."""


def keep_verified(scored: list[ScoredSample], threshold: float) -> list[ScoredSample]:
    """Samples whose summed reward is >= ``threshold``, each distinct completion of a prompt once, in order."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    kept = []
    for x in scored:
        key = (x.sample.prompt_uid, tuple(x.sample.completion_ids))
        if x.reward >= threshold and key not in seen:
            seen.add(key)
            kept.append(x)
    return kept


def sft_batch(samples: list[Sample], size: int, pad_id: int) -> TrainBatch:
    """The kept samples as a batch of exactly ``size`` rows, advantage 1 on every completion token.

    The learner's DeepSpeed config fixes the batch at ``data.prompts_per_step * rollout.group_size`` sequences
    (micro-batch x accumulation x ranks), and RFT keeps fewer. Rows past the kept ones repeat kept samples
    with an all-zero response mask: they add no token to the loss nor to its token count (``LossScale`` is
    computed from the mask), so the update equals the one on the kept samples alone. Repeating real samples
    (rather than empty rows) keeps every row a valid sequence for the forward pass.
    """
    if not 1 <= len(samples) <= size:
        raise ValueError(f"sft_batch needs 1..{size} samples, got {len(samples)}")
    rows = [samples[i % len(samples)] for i in range(size)]
    batch = build_batch([s.prompt_ids for s in rows], [s.completion_ids for s in rows], [s.logprobs for s in rows],
                        pad_id)
    batch.response_mask[len(samples):] = 0.0
    batch.advantages = batch.response_mask.clone()
    return batch


def rft_config(cfg: FleetConfig, rounds: int | None = None) -> FleetConfig:
    """The config RFT runs with: ``rft.rounds`` (or ``rounds``) training steps, an eval after every round, no
    dynamic sampling, and the policy loss reduced to the supervised NLL (:data:`SFT_LOSS`, one epoch, one
    minibatch). The algorithm section is replaced: RFT has no advantage estimator and no critic."""
    if rounds is not None and rounds < 1:
        raise ConfigError(f"--rounds {rounds}: RFT needs at least 1 round")
    tree = cfg.model_dump()
    tree["rft"]["rounds"] = rounds or cfg.rft.rounds
    tree["trainer"].update(total_steps=tree["rft"]["rounds"], eval_every=1)
    tree["rollout"]["dynamic_sampling"] = False
    tree["learner"].update(epochs=1, num_minibatches=1)
    tree["algorithm"] = {"name": "grpo", **SFT_LOSS}
    return FleetConfig.model_validate(tree)


class RFTTrainer(Trainer):
    """The Trainer's loop (evals, checkpoints, metrics, final policy) with the RFT round as its training step."""

    def start(self) -> None:
        super().start()
        # RFT rounds are logged to their own file (TensorBoard and progress.png as for training)
        (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        self.metrics.path = self.run_dir / "rft_metrics.jsonl"
        self.metrics.path.write_text("")

    def train_step(self, step: int) -> dict:
        """One round: generate, score, keep the verified-correct samples, supervised update, push weights."""
        timer = PhaseTimer()
        scored, reward_errors, _ = self.collect(step, timer)
        kept = keep_verified(scored, self.cfg.rft.threshold)
        correct = [is_correct(self.task.verifier_fn, x.sample.prompt_text, x.sample.completion_text, x.sample.metadata)
                   for x in scored]
        out = {"rft/kept_fraction": len(kept) / len(scored), "rft/kept": len(kept),
               "rft/prompts_with_kept": len({x.sample.prompt_uid for x in kept}),
               "train/accuracy": sum(correct) / len(correct), "reward/errors": reward_errors,
               "reward/mean": sum(x.reward for x in scored) / len(scored), "rollout/samples": len(scored)}
        if kept:
            with timer("logprobs"):
                batch = self.learner.compute_logprobs(sft_batch([x.sample for x in kept], len(scored), self.pad_id))
            mask = batch.response_mask.bool()
            out["rollout/logprob_gap_max"] = (batch.old_logprobs - batch.rollout_logprobs).abs()[mask].max().item()
            out["rft/nll_before"] = -batch.old_logprobs[mask].mean().item()  # token-mean NLL of the kept samples
            with timer("learn"):
                out.update(learner_metrics(self.learn(batch)))
            with timer("sync"):
                out.update(self.push_weights())
        else:
            log.warning("rft round %d: no sample reached rft.threshold=%s; no update this round", step,
                        self.cfg.rft.threshold)
        log.info("rft round %d: kept %d/%d samples (%.1f%%), train accuracy %.3f", step, len(kept), len(scored),
                 100 * out["rft/kept_fraction"], out["train/accuracy"])
        return {**out, **timer.metrics()}

    def finish(self, train_seconds: float) -> None:
        super().finish(train_seconds)
        summary_path = self.run_dir / "summary.json"
        summary = json.loads(summary_path.read_text())
        summary.update(algorithm="rft", rounds=self.cfg.rft.rounds)
        summary_path.write_text(json.dumps(summary, indent=1))


def run_rft(cfg: FleetConfig, rounds: int | None = None) -> list[dict]:
    """Check the run directory, start (or join) Ray, run the rounds; returns the per-round rows."""
    from orchestrator.trainer import init_ray

    cfg = rft_config(cfg, rounds)
    if (Path(cfg.run.dir) / "metrics.jsonl").exists():
        raise ConfigError(f"run.dir={cfg.run.dir} holds a training run (metrics.jsonl); RFT would overwrite its "
                          "final policy: give a fresh run.dir (and the trained policy as model.path)")
    trainer = RFTTrainer(cfg)
    init_ray(cfg)
    return trainer.run()
