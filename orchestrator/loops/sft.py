"""`fleetrl sft`: supervised fine-tuning on the same DeepSpeed learner group as RL (same actors, ZeRO stages,
packing, token-budget micro-batches). The learner trains the registered ``sft`` loss (the token-mean NLL of the
assistant tokens); the driver (:class:`orchestrator.rl.driver.Run`) gives evals through the engines with the task's
verifier, checkpoints, resume, metrics and ``final/`` in the run-dir layout of RL.

Weights reach the engines only when they are about to generate (an eval): SFT steps themselves need no engine.
"""

from __future__ import annotations

import logging
import time

from orchestrator.config import ConfigError, FleetConfig
from orchestrator.data import Example, ExampleRenderer, draw, examples_batch, load_sft_rows
from orchestrator.rl.driver import Loop, Run, StepOutcome, learner_metrics
from orchestrator.rl.fleet import Roles, training_roles
from orchestrator.telemetry.metrics import PhaseTimer
from rewards.datasets import DatasetError

log = logging.getLogger("fleetrl")


def objective_config(cfg: FleetConfig, algorithm: dict) -> FleetConfig:
    """``cfg`` with its algorithm section replaced (SFT, DPO: no advantage estimator, no critic) and the learner
    settings a supervised batch needs (one epoch, one minibatch, no dynamic sampling)."""
    tree = cfg.model_dump()
    tree["algorithm"] = algorithm
    tree["rollout"]["dynamic_sampling"] = False
    tree["learner"].update(epochs=1, num_minibatches=1)
    return FleetConfig.model_validate(tree)


def sft_config(cfg: FleetConfig) -> FleetConfig:
    """The SFT objective's config, ``sft.data`` read and checked (a DatasetError names the file and line)."""
    if not cfg.sft.data:
        raise ConfigError("sft.data: give a JSONL file of prompt/response or messages rows (`fleetrl data "
                          "cold-start` writes one for the built-in tasks)")
    load_sft_rows(cfg.sft.data)
    return objective_config(cfg, {"name": "sft"})


def render_rows(path: str, renderer: ExampleRenderer) -> list[Example]:
    """Every SFT row of ``path`` rendered; a row that cannot be is an error naming its line."""
    out = []
    for i, row in enumerate(load_sft_rows(path)):
        try:
            out.append(renderer.sft(row["messages"], row.get("tools")))
        except DatasetError as e:
            raise DatasetError(f"{path}: row {i + 1}: {e}") from e
    return out


class SFTLoop(Loop):
    """A supervised step over ``sft.data``. Its steps never generate: engines start only
    for evals (``trainer.eval_every`` > 0) and get the weights just before one."""

    @classmethod
    def roles(cls, cfg: FleetConfig) -> Roles:
        return training_roles(cfg, generates=False)

    prepare = staticmethod(sft_config)

    def __init__(self, run: Run):
        super().__init__(run)
        self.cfg = cfg = run.cfg
        renderer = ExampleRenderer(run.tokenizer, cfg.data.prompt_format, cfg.data.system_prompt,
                                   cfg.data.chat_template_kwargs)
        self.examples = render_rows(cfg.sft.data, renderer)
        log.info("sft data %s: %d rows", cfg.sft.data, len(self.examples))

    def train_step(self, step: int) -> StepOutcome:
        timer = PhaseTimer()
        t0 = time.perf_counter()
        rows = [self.examples[i] for i in draw(len(self.examples), step, self.cfg.sequences_per_step,
                                               self.cfg.trainer.seed)]
        batch = examples_batch(rows, self.cfg.sequences_per_step, self.run.pad_id)
        with timer("learn"):
            update = self.run.learn(batch)
        tokens = int(batch.response_mask.sum())
        return StepOutcome({**learner_metrics(update.metrics), "sft/tokens": tokens,
                           "sft/epoch": (step + 1) * len(rows) / len(self.examples),
                           "throughput/tokens_per_s": tokens / (time.perf_counter() - t0), **timer.metrics()},
                          update.skipped, engines_stale=True)


def run_sft(cfg: FleetConfig, resume: str | None = None, fleet=None) -> list[dict]:
    from orchestrator.rl.driver import run_training

    return run_training(cfg, resume=resume, loop=SFTLoop, fleet=fleet)
