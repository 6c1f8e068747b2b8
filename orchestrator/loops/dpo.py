"""DPO (``algorithm.name: dpo``) on the learner group: the registered ``dpo`` loss over (chosen, rejected) row
pairs, the frozen reference being the stage's starting policy (``model.path``).

- Offline (``algorithm.pairs``): each step trains on ``sequences_per_step / 2`` pairs of the JSONL file (seeded
  per-epoch shuffles: a resumed run sees the same pairs).
- Online: each step generates the usual groups, scores them, and pairs every group's best and worst sample when
  their rewards differ by at least ``algorithm.min_reward_gap`` (:func:`learner.algorithms.preference_pairs`).
"""

from __future__ import annotations

import logging
import time

import torch

from learner.algorithms import preference_pairs
from orchestrator.config import FleetConfig
from orchestrator.data import (
    Example,
    ExampleRenderer,
    draw,
    examples_batch,
    load_pairs,
    sample_example,
)
from orchestrator.loops.policy import check_rewards
from orchestrator.rl.collect import sample_ages
from orchestrator.rl.driver import Loop, Run, StepOutcome, learner_metrics
from orchestrator.rl.fleet import Roles, training_roles
from orchestrator.telemetry.metrics import PhaseTimer

log = logging.getLogger("fleetrl")


class DPOLoop(Loop):
    """Offline (a pairs file): engines start only for evals, and get the weights just before one; online: the
    RL loop's fleet."""

    @classmethod
    def prepare(cls, cfg: FleetConfig) -> FleetConfig:
        """Offline: the pairs file read and checked at load; online: the rewards, as RL's."""
        if cfg.algorithm.pairs:
            load_pairs(cfg.algorithm.pairs)
        else:
            check_rewards(cfg)
        return cfg

    @classmethod
    def roles(cls, cfg: FleetConfig) -> Roles:
        return training_roles(cfg, generates=not cfg.algorithm.pairs)

    def __init__(self, run: Run):
        super().__init__(run)
        self.cfg = cfg = run.cfg
        self.pairs: list[tuple[Example, Example]] = []
        self.preferences: list[float] = []  # each offline pair's soft label, P(chosen is better)
        if cfg.algorithm.pairs:
            renderer = ExampleRenderer(run.tokenizer, cfg.data.prompt_format, cfg.data.system_prompt,
                                       cfg.data.chat_template_kwargs)
            rows = load_pairs(cfg.algorithm.pairs)
            self.pairs = [(renderer.completion(r["prompt"], r["chosen"]),
                           renderer.completion(r["prompt"], r["rejected"])) for r in rows]
            self.preferences = [r["preference"] for r in rows]
            log.info("dpo pairs %s: %d rows", cfg.algorithm.pairs, len(self.pairs))

    def train_step(self, step: int) -> StepOutcome:
        return self.offline_step(step) if self.pairs else self.online_step(step)

    def offline_step(self, step: int) -> StepOutcome:
        timer = PhaseTimer()
        t0 = time.perf_counter()
        idx = draw(len(self.pairs), step, self.cfg.sequences_per_step // 2, self.cfg.trainer.seed)
        result = self._update([self.pairs[i] for i in idx], timer, [self.preferences[i] for i in idx])
        result.engines_stale = True
        result.metrics.update({"throughput/pairs_per_s": len(idx) / (time.perf_counter() - t0), **timer.metrics()})
        return result

    def online_step(self, step: int) -> StepOutcome:
        timer = PhaseTimer()
        collected = self.run.source.take(step, timer)
        scored, reward_errors = collected.scored, collected.reward_errors
        rewards = [x.reward for x in scored]
        chosen = preference_pairs(rewards, [x.sample.prompt_uid for x in scored], self.cfg.algorithm.min_reward_gap)
        correct = self.run.correct([x.sample for x in scored])
        out = {"reward/mean": sum(rewards) / len(rewards), "reward/errors": reward_errors,
               "train/accuracy": sum(correct) / len(correct), "rollout/samples": len(scored),
               "tokens_generated": sum(len(x.sample.completion_ids) for x in scored),
               **collected.info, **sample_ages(scored, self.run.version)}
        skipped = False
        if chosen:
            pairs = [(sample_example(scored[i].sample), sample_example(scored[j].sample)) for i, j in chosen]
            update = self._update(pairs, timer)
            out.update(update.metrics)
            skipped = update.skipped_update
            out.update(self.run.sync_weights(timer)[0])
        else:
            log.warning("dpo step %d: no group had a reward gap >= algorithm.min_reward_gap=%s; no update", step,
                        self.cfg.algorithm.min_reward_gap)
            out["dpo/pairs"] = 0
        out = {**out, **timer.metrics()}
        out["throughput/tokens_per_s"] = out["tokens_generated"] / out["time/step_s"]
        return StepOutcome(out, skipped, reward_errors)

    def _update(self, pairs: list[tuple[Example, Example]], timer: PhaseTimer,
                preferences: list[float] | None = None) -> StepOutcome:
        rows = [e for pair in pairs for e in pair]
        batch = examples_batch(rows, self.cfg.sequences_per_step, self.run.pad_id, rows_per_unit=2)
        if preferences and any(p != 1.0 for p in preferences):  # soft labels ride on both rows of their pair
            batch.targets = torch.zeros_like(batch.response_mask)
            batch.targets[:len(rows)] = torch.tensor([p for p in preferences for _ in (0, 1)])[:, None]
        with timer("learn"):
            update = self.run.learn(batch)
        return StepOutcome({**learner_metrics(update.metrics), "dpo/pairs": len(pairs)}, update.skipped)
