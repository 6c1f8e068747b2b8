"""`fleetrl rft`: rejection-sampling fine-tuning (RFT; Yuan et al. 2023, "Scaling Relationship on Learning
Mathematical Reasoning with LLMs"; the expert-iteration / STaR family).

Each round, on the same actors as `fleetrl train`:

    generate G samples for each of `data.prompts_per_step` prompts -> score -> keep the verified-correct ones
    (summed reward >= `rft.threshold`, identical completions of a prompt kept once) -> one supervised update on
    them through the DeepSpeed learner group -> push the weights to the engines

The update is the registered ``sft`` loss (the token-mean NLL of the kept completions, :mod:`orchestrator.loops.sft`)
on the same learner group. Evals, checkpoints and the final policy are the driver's (:class:`orchestrator.rl.driver.
Run`; :class:`RFTLoop` is the training step); one row per round goes to ``<run.dir>/metrics.jsonl``.
"""

from __future__ import annotations

import logging

from orchestrator.config import ConfigError, FleetConfig
from orchestrator.data import examples_batch, sample_example
from orchestrator.loops.policy import check_rewards
from orchestrator.loops.sft import objective_config
from orchestrator.rl.collect import sample_ages
from orchestrator.rl.driver import Loop, Run, StepOutcome, learner_metrics
from orchestrator.rl.episode_metrics import episode_return
from orchestrator.rl.fleet import Roles, training_roles
from orchestrator.telemetry.metrics import PhaseTimer
from workers.records import ScoredSample

log = logging.getLogger("fleetrl")


def keep_verified(scored: list[ScoredSample], threshold: float) -> list[ScoredSample]:
    """Samples whose summed reward (an environment's or agent's included) is >= ``threshold``, each distinct
    completion of a prompt once, in order."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    kept = []
    for x in scored:
        key = (x.sample.prompt_uid, tuple(x.sample.completion_ids))
        if episode_return(x) >= threshold and key not in seen:
            seen.add(key)
            kept.append(x)
    return kept


def rft_config(cfg: FleetConfig, rounds: int | None = None) -> FleetConfig:
    """The config RFT runs with: ``rft.rounds`` (or ``rounds``) training steps, an eval after every round, and the
    ``sft`` objective (:func:`orchestrator.loops.sft.objective_config`: no advantage estimator, no critic)."""
    if rounds is not None and rounds < 1:
        raise ConfigError(f"--rounds {rounds}: RFT needs at least 1 round")
    tree = objective_config(cfg, {"name": "sft"}).model_dump()
    tree["rft"]["rounds"] = rounds or cfg.rft.rounds
    tree["trainer"].update(total_steps=tree["rft"]["rounds"], eval_every=1)
    return FleetConfig.model_validate(tree)


class RFTLoop(Loop):
    """The RFT round as the training step; it samples every round, as RL does."""

    def __init__(self, run: Run):
        super().__init__(run)
        self.cfg = run.cfg

    @classmethod
    def prepare(cls, cfg: FleetConfig) -> FleetConfig:
        check_rewards(cfg)
        return cfg

    @classmethod
    def roles(cls, cfg: FleetConfig) -> Roles:
        return training_roles(cfg, generates=True)

    def train_step(self, step: int) -> StepOutcome:
        """One round: generate, score, keep the verified-correct samples, supervised update, push weights."""
        timer = PhaseTimer()
        collected = self.run.source.take(step, timer)
        scored, reward_errors = collected.scored, collected.reward_errors
        kept = keep_verified(scored, self.cfg.rft.threshold)
        correct = self.run.correct([x.sample for x in scored])
        out = {"rft/kept_fraction": len(kept) / len(scored), "rft/kept": len(kept),
               "rft/prompts_with_kept": len({x.sample.prompt_uid for x in kept}),
               "train/accuracy": sum(correct) / len(correct), "reward/errors": reward_errors,
               "reward/mean": sum(map(episode_return, scored)) / len(scored), "rollout/samples": len(scored),
               "tokens_generated": sum(len(x.sample.completion_ids) for x in scored),
               **collected.info, **sample_ages(scored, self.run.version)}
        skipped = False
        if kept:
            batch = examples_batch([sample_example(x.sample) for x in kept], len(scored), self.run.pad_id)
            with timer("learn"):
                update = self.run.learn(batch)
            out.update(learner_metrics(update.metrics))
            skipped = update.skipped
            out.update(self.run.sync_weights(timer)[0])
        else:
            log.warning("rft round %d: no sample reached rft.threshold=%s; no update this round", step,
                        self.cfg.rft.threshold)
        log.info("rft round %d: kept %d/%d samples (%.1f%%), train accuracy %.3f", step, len(kept), len(scored),
                 100 * out["rft/kept_fraction"], out["train/accuracy"])
        out.update(timer.metrics())
        out["throughput/tokens_per_s"] = out["tokens_generated"] / out["time/step_s"]
        return StepOutcome(out, skipped, reward_errors)

    def summary(self) -> dict:
        return {"algorithm": "rft", "rounds": self.cfg.rft.rounds}


def run_rft(cfg: FleetConfig, rounds: int | None = None, resume: str | None = None, fleet=None) -> list[dict]:
    """Check the run directory, start (or join) Ray, run the rounds; returns the per-round rows."""
    from orchestrator.rl.driver import run_training

    cfg = rft_config(cfg, rounds)  # an earlier run in run.dir is refused by run_training, as for every loop
    return run_training(cfg, resume, loop=RFTLoop, fleet=fleet)
