"""Steps of a solution: the separator that ends a step, and where steps end in the sampled tokens (process
rewards, PRM labels, step-level search)."""

from __future__ import annotations

from orchestrator.config import FleetConfig
from rewards.tasks import make_task_from_config


def process_separator(cfg: FleetConfig) -> str:
    """The step separator of process rewards: ``algorithm.step_separator`` (grpo_process) when set, else
    :func:`step_separator`."""
    own = getattr(cfg.algorithm, "step_separator", None)
    return own if own is not None else step_separator(cfg)


def step_separator(cfg: FleetConfig) -> str:
    """``data.step_separator``, else the built-in task's (``chain`` compact: ``;``), else a newline."""
    if cfg.data.step_separator:
        return cfg.data.step_separator
    return "\n" if cfg.data.path else make_task_from_config(cfg.data).step_separator


def step_ends(token_texts: list[str], separator: str) -> list[int]:
    """Token indices that end a step: tokens containing ``separator`` (every token when it is ""), and the last."""
    ends = [i for i, t in enumerate(token_texts) if separator == "" or separator in t]
    if token_texts and (not ends or ends[-1] != len(token_texts) - 1):
        ends.append(len(token_texts) - 1)
    return ends
