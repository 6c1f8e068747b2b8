"""A Bradley-Terry preference (reward) model (``algorithm.name: reward_model``) on the learner group, from
preference pairs (``algorithm.pairs``: the rows `fleetrl cai prefer` writes, or any DPO pairs file; soft labels
``preference`` allowed).

Each response is laid out as an outcome reward model (:mod:`rewards.prm`): the response cut into steps at the
step separator, the tag token after every step, and the score the log-odds of the tag at the last one; the
registered ``bradley_terry`` loss trains ``-q log sigmoid(r_chosen - r_rejected) - (1 - q) log sigmoid(r_rejected
- r_chosen)``. ``final/`` is an HF causal LM with ``fleetrl_prm.json`` (``target: preference``): the ``orm-i``
actors serve it (``prm.orm_path``; its served score ``p(tag)`` is ``sigmoid(r)``). The held-out pairs
(``algorithm.eval_fraction`` of the prompts) give ``rm/heldout_accuracy``: how often the model ranks the labelled
better response first.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from learner.losses import tag_log_odds
from orchestrator.config import ConfigError, FleetConfig
from orchestrator.data import draw, load_pairs
from orchestrator.loops.process_reward import PRMExample, held_out, prm_batch
from orchestrator.rl.driver import Loop, Run, StepOutcome, learner_metrics
from orchestrator.rl.fleet import Roles, training_roles
from orchestrator.rl.reasoning_steps import step_separator
from orchestrator.telemetry.metrics import PhaseTimer
from rewards.prm import encode, split_steps, tag_id, write_meta
from workers.prompts import PromptRenderer

log = logging.getLogger("fleetrl")


def response_text(response) -> str:
    """A pair side as text: the string, or the content of its assistant messages."""
    if isinstance(response, str):
        return response
    return "".join(m["content"] for m in response if m.get("role") == "assistant")


def split_pairs(cfg: FleetConfig) -> tuple[list[dict], list[dict]]:
    """(training, held-out) rows of ``algorithm.pairs`` for ``algorithm.eval_fraction``; both must be non-empty."""
    if not cfg.algorithm.pairs:
        raise ConfigError("algorithm.pairs: a reward model trains on preference pairs; give a JSONL file of "
                          "prompt/chosen/rejected rows (`fleetrl cai prefer` writes one)")
    rows, fraction = load_pairs(cfg.algorithm.pairs), cfg.algorithm.eval_fraction
    train = [r for r in rows if not held_out(r, fraction)]
    held = [r for r in rows if held_out(r, fraction)]
    if not train or not held:
        raise ConfigError(f"algorithm.pairs {cfg.algorithm.pairs}: {len(train)} training and {len(held)} held-out "
                          f"pairs with algorithm.eval_fraction={fraction}; give more")
    return train, held


class RewardModelLoop(Loop):
    """A Bradley-Terry step over ``algorithm.pairs`` (see the module); the learner group
    alone (its evals are the learner's own scores)."""

    @classmethod
    def roles(cls, cfg: FleetConfig) -> Roles:
        return training_roles(cfg, generates=False, engine_evals=False)

    @classmethod
    def prepare(cls, cfg: FleetConfig) -> FleetConfig:
        """The pairs file read and its held-out split checked at load."""
        split_pairs(cfg)
        return cfg

    def __init__(self, run: Run):
        super().__init__(run)
        self.cfg = cfg = run.cfg
        self.tokenizer = run.tokenizer
        self.tag, self.sep = tag_id(self.tokenizer, cfg.prm.tag), step_separator(cfg)
        self.renderer = PromptRenderer(self.tokenizer, cfg.data.prompt_format, cfg.data.system_prompt,
                                       cfg.data.chat_template_kwargs)
        self.train_rows, self.held = split_pairs(cfg)
        log.info("reward model pairs %s: %d training / %d held-out", cfg.algorithm.pairs, len(self.train_rows),
                 len(self.held))

    def side(self, prompt, response, label: float) -> PRMExample:
        """One response in the outcome layout: mask 1 (and the pair's label) on its last tag only."""
        steps = split_steps(response_text(response), self.sep) or [" "]
        prompt_ids, ids, positions = encode(self.tokenizer, self.renderer.render(prompt)[0], steps, self.tag)
        mask, targets = [0] * len(ids), [0.0] * len(ids)
        mask[positions[-1]], targets[positions[-1]] = 1, label
        return PRMExample(prompt_ids, ids, mask, targets)

    def pair(self, row: dict) -> list[PRMExample]:
        q = row["preference"]
        return [self.side(row["prompt"], row["chosen"], q), self.side(row["prompt"], row["rejected"], q)]

    def train_step(self, step: int) -> StepOutcome:
        timer = PhaseTimer()
        n = self.cfg.sequences_per_step
        idx = draw(len(self.train_rows), step, n // 2, self.cfg.trainer.seed)
        rows = [e for i in idx for e in self.pair(self.train_rows[i])]
        with timer("learn"):
            update = self.run.learn(prm_batch(rows, n, self.run.pad_id, rows_per_unit=2))
        return StepOutcome({**learner_metrics(update.metrics), "rm/epoch": (step + 1) * len(idx) / len(self.train_rows),
                           **timer.metrics()}, update.skipped)

    def held_out_margins(self) -> list[float]:
        """``r_chosen - r_rejected`` of every held-out pair under the current model."""
        n, margins = self.cfg.sequences_per_step, []
        for i in range(0, len(self.held), n // 2):
            chunk = self.held[i: i + n // 2]
            rows = [e for r in chunk for e in self.pair(r)]
            batch = self.run.fleet.learner.compute_logprobs(prm_batch(rows, n, self.run.pad_id, rows_per_unit=2))
            scores = [float(tag_log_odds(batch.old_logprobs[j, e.loss_mask.index(1)])) for j, e in enumerate(rows)]
            margins += [scores[2 * k] - scores[2 * k + 1] for k in range(len(chunk))]
        return margins

    def evaluate(self, step: int) -> dict:
        t0 = time.perf_counter()
        margins = self.held_out_margins()
        labels = [r["preference"] for r in self.held]
        decided = [(m, q) for m, q in zip(margins, labels) if q != 0.5]
        return {"rm/heldout_accuracy": sum((m > 0) == (q > 0.5) for m, q in decided) / max(len(decided), 1),
                "rm/heldout_margin": sum(margins) / len(margins), "rm/heldout_pairs": len(decided),
                "time/eval_s": time.perf_counter() - t0}

    def on_final(self, final: Path) -> None:
        evals = [m for m in self.run.metrics.history if "rm/heldout_accuracy" in m]
        write_meta(final, {"tag": self.cfg.prm.tag, "separator": self.sep, "target": "preference",
                                            "pairs": self.cfg.algorithm.pairs, "base": self.cfg.model.path,
                                            **({"rm/heldout_accuracy": evals[-1]["rm/heldout_accuracy"]}
                                               if evals else {})})
