"""The ``judge`` reward (:mod:`rewards.judge`, Constitutional AI's feedback model as a reward): its constitution,
judge model and option tokens checked before any actor starts (:func:`reward_judge`; the run holds the judge)."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.config import ConfigError, FleetConfig
from orchestrator.rl.launch import load_tokenizer
from rewards.constitution import Constitution, ConstitutionError, load_constitution, option_token_ids
from rewards.judge import Judge


def reward_judge(cfg: FleetConfig) -> Judge:
    """The ``judge`` reward of ``reward.functions`` (:mod:`rewards.judge`), its judge model and option tokens
    checked before any actor starts."""
    try:
        constitution = load_constitution(cfg.cai.principles)
    except ConstitutionError as e:
        raise ConfigError(f"cai.principles: {e}") from None
    on_error = float(cfg.judge_spec.params.get("on_error", 0.0))  # checked by the config
    return Judge(constitution, check_judge(cfg, constitution), cfg.cai.both_orders, on_error, cfg.reward.strict)


def check_judge(cfg: FleetConfig, constitution: Constitution) -> list[int]:
    """The judge's option token ids; a judge model that is not a local causal LM with a chat template, or an
    option that is not one token of its tokenizer, is a ConfigError naming the key."""
    path = cfg.cai.feedback_model or cfg.model.path
    key = "cai.feedback_model" if cfg.cai.feedback_model else "model.path"
    config = Path(path) / "config.json"
    try:
        archs = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError):
        raise ConfigError(f"{key}: {path!r} is not a model directory (no readable config.json)") from None
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ConfigError(f"{key}: {path!r} is not a causal LM (architectures {archs}); the judge reads next-token "
                          "probabilities, so it must be one (e.g. LlamaForCausalLM)")
    tokenizer = load_tokenizer(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{key}: {path!r} has no chat template; the judge's question is a chat conversation")
    try:
        return option_token_ids(tokenizer, constitution.options)
    except ConstitutionError as e:
        raise ConfigError(f"cai.principles {cfg.cai.principles or '(default)'}: {e}") from None
