"""``learner.lora``: LoRA adapters on the policy (PEFT), as config data.

The behaviour lives in :mod:`learner.lora`; this module holds the settings and the load-time checks, and imports
neither torch nor PEFT: the target-module check reads tensor names from the model's safetensors headers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.config.section import Section

ALL_LINEAR: Literal["all-linear"] = "all-linear"


class LoraSection(Section):
    rank: int = Field(0, ge=0, le=4096)
    """LoRA rank r of every adapted linear layer; 0 (the default) trains the full weights. With r > 0 only the
    adapters (A: r x in, B: out x r, B starting at zero) are trainable and in the optimizer; the frozen base is
    also the KL reference (the same weights with the adapter switched off: no second copy)."""
    alpha: float = Field(16.0, gt=0.0)
    """LoRA scaling numerator: the update is (alpha / rank) * B A."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input in training passes. 0 keeps the learner's logprobs equal to the engines'
    (the learner disables every other dropout for that reason)."""
    target_modules: list[str] | Literal["all-linear"] = ALL_LINEAR
    """Which linear layers get an adapter: `all-linear` (every linear layer but the LM head) or module names
    (`[q_proj, v_proj]`: every module whose name ends in one of them)."""
    push: Literal["merged", "adapter"] = "merged"
    """How the policy reaches the engines: `merged` sends base + (alpha / rank) B A of the blocks with adapters
    (the other tensors never change, so they are not resent; the engines need no LoRA support); `adapter` sends
    the adapter tensors alone and the engines serve base + adapter (vLLM LoRA, each policy version a new
    `LoRARequest`, the previous one unloaded)."""

    critic: bool = False
    """PPO's critic (an algorithm with a value model) trains LoRA adapters too: its own adapters of the same rank,
    alpha and target modules, plus its fresh value head, on its own frozen copy of the base (set
    `algorithm.critic_lr` for them: LoRA wants ~10x the full-weight rate). False: the critic trains full weights.
    Ignored by algorithms without a critic (so a pipeline's stages can share the `learner` section)."""

    @field_validator("critic")
    @classmethod
    def _critic_needs_rank(cls, value: bool, info):
        if value and not info.data.get("rank"):
            raise ValueError("true adapts the critic like the policy and needs learner.lora.rank > 0")
        return value

    @model_validator(mode="after")
    def _adapter_rank(self) -> LoraSection:
        if self.push == "adapter" and self.rank > VLLM_MAX_LORA_RANKS[-1]:
            raise ValueError(f"push: adapter serves the adapter in vLLM, whose largest LoRA rank is "
                             f"{VLLM_MAX_LORA_RANKS[-1]}; got rank {self.rank} (use push: merged)")
        return self

    @field_validator("target_modules")
    @classmethod
    def _nonempty(cls, value):
        if isinstance(value, list) and (not value or any(not m.strip() for m in value)):
            raise ValueError(f"target_modules must be `{ALL_LINEAR}` or a non-empty list of module names, "
                             f"got {value!r}")
        return value

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def spec(self) -> dict | None:
        """The plain dict the learner ranks take (None: full fine-tuning)."""
        if not self.enabled:
            return None
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": self.target_modules, "push": self.push}

    def engine_spec(self) -> dict | None:
        """What the rollout engines need to serve the adapter (`push: adapter`), else None."""
        if not self.enabled or self.push != "adapter":
            return None
        return {"rank": self.rank, "alpha": self.alpha, "max_rank": engine_max_rank(self.rank)}


VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for an engine's ``max_lora_rank``."""


def engine_max_rank(rank: int) -> int:
    return next((r for r in VLLM_MAX_LORA_RANKS if r >= rank), VLLM_MAX_LORA_RANKS[-1])


def check_lora(lora: LoraSection, model_path: str) -> None:
    """The check that needs the rest of the config: target modules the model really has."""
    if not lora.enabled:
        return
    missing = missing_targets(model_path, lora.target_modules)
    if missing:
        raise ValueError(f"learner.lora.target_modules: {missing} match no module of {model_path}; give module "
                         "names the model has (e.g. q_proj, v_proj) or `all-linear`")


def missing_targets(model_path: str | Path, targets: list[str] | str) -> list[str] | None:
    """The target module names that no module of the model at ``model_path`` ends with (``[]``: all found);
    None when the model's weights are not there to read (an embedded model built on first use)."""
    names = tensor_names(Path(model_path))
    if names is None or targets == ALL_LINEAR:
        return None if names is None else []
    modules = {n.rsplit(".", 1)[0] for n in names}
    return [t for t in targets if not any(m == t or m.endswith("." + t) for m in modules)]


def tensor_names(model_dir: Path) -> list[str] | None:
    """Every tensor name in the model's safetensors files (read from the file headers), None when it has none."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    names = []
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        names += [k for k in header if k != "__metadata__"]
    return names
