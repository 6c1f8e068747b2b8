"""The training loops besides RL, on the same actors as `fleetrl train`: supervised fine-tuning (`sft`), DPO
(`dpo`), the Bradley-Terry reward model (`preference_model`), the process reward model (`process_reward`: labels and
training) and rejection-sampling fine-tuning (`rft`).

The training loop of a config is chosen once, here, from its algorithm's objective (:data:`LOOPS`); the loop's
``prepare`` checks every input it will read (data files, pairs geometry, labels) at load, before any actor."""

from __future__ import annotations

import importlib

LOOPS = {
    "policy": "orchestrator.loops.policy:PolicyLoop",
    "sft": "orchestrator.loops.sft:SFTLoop",
    "dpo": "orchestrator.loops.dpo:DPOLoop",
    "bradley_terry": "orchestrator.loops.preference_model:RewardModelLoop",
    "prm": "orchestrator.loops.process_reward:PRMLoop",
}
"""Objective (the algorithm config class's ``objective``) -> its loop."""


def loop_for(cfg) -> type:
    """The loop that trains ``cfg``'s objective: policy gradients (:class:`orchestrator.loops.policy.PolicyLoop`),
    SFT, DPO, a Bradley-Terry reward model or a PRM (each a :class:`orchestrator.rl.driver.Loop` the driver holds)."""
    module, name = LOOPS[cfg.algorithm.objective].split(":")
    return getattr(importlib.import_module(module), name)


def prepare(cfg):
    """The config ``cfg``'s loop runs with, every input it reads checked (a ConfigError or DatasetError naming the
    key, file and line): what `fleetrl config show` and every training command do at load."""
    return loop_for(cfg).prepare(cfg)


def train(cfg, resume: str | None = None, fleet=None, checked: bool = False) -> list[dict]:
    """`fleetrl train`: the config's loop run by the driver (:func:`orchestrator.rl.driver.run_training`); its
    metrics rows."""
    from orchestrator.rl.driver import run_training

    return run_training(cfg, resume, loop=loop_for(cfg), fleet=fleet, checked=checked)
