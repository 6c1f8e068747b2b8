"""``cai``: Constitutional AI settings (``fleetrl cai revise|prefer``, the pipeline's ``cai_revisions`` and
``ai_preferences`` data), as config data. The behaviour lives in :mod:`orchestrator.recipes.cai` and
:mod:`rewards.constitution`."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from orchestrator.config.section import Section


class CAISection(Section):
    principles: str | None = None
    """The constitution: a YAML file of principles (critique request, revision request, preference question,
    optional rule); unset: the shipped set (`rewards/principles.yaml`, docs/cai.md)."""
    revisions: int = Field(1, ge=1, le=8)
    """SL-CAI: critique -> revision rounds per prompt, each against a principle drawn at random among those that
    apply to the prompt."""
    judge: Literal["policy", "model", "rule"] = "policy"
    """RL-CAI: who labels a pair of responses. `policy`: the policy itself, on the rollout engines; `model`: the
    `cai.feedback_model` on engines of its own; `rule`: the drawn principle's rule function (a baseline: the
    labels a perfect judge would give)."""
    feedback_model: str | None = None
    """With `judge: model`: any local HF causal LM directory with a chat template."""
    both_orders: bool = True
    """Ask the judge with the two responses in both orders and average (cancels a preference for a position)."""

    @model_validator(mode="after")
    def _judge_model(self) -> CAISection:
        if (self.judge == "model") != bool(self.feedback_model):
            raise ValueError("cai.judge: model needs cai.feedback_model (a model directory), and "
                             "cai.feedback_model is only read with cai.judge: model")
        return self

    @model_validator(mode="after")
    def _principles(self) -> CAISection:
        if self.principles:
            from rewards.constitution import load_constitution

            load_constitution(self.principles)  # a ConstitutionError (a ValueError) names the file and key
        return self


def check_judge_reward(functions: list, cai: CAISection, prompt_format: str) -> None:
    """The checks of a `judge` entry in `reward.functions`: listed once, known params, a judge that reads chat
    questions, and a rubric question for every principle."""
    from rewards.judge import NAME, PARAMS

    judges = [f for f in functions if f.name == NAME]
    if not judges:
        return
    if len(judges) > 1:
        raise ValueError("reward.functions: judge is listed more than once; give it once")
    bad = sorted(set(judges[0].params) - set(PARAMS))
    if bad:
        raise ValueError(f"reward function judge: unknown params {bad}; allowed: {sorted(PARAMS)}")
    value = judges[0].params.get("on_error", 0.0)
    if isinstance(value, bool | str) or not math.isfinite(value):
        raise ValueError(f"reward function judge: params.on_error must be a finite number, got {value!r}")
    if cai.judge == "policy" and prompt_format == "raw":
        raise ValueError("reward.functions: judge with cai.judge: policy asks the policy chat questions; "
                         "data.prompt_format raw has none (use auto or chat, or cai.judge: model)")
    if cai.judge == "rule":
        raise ValueError("reward.functions: judge needs cai.judge: policy or model (a rule is a reward "
                         "function of its own: use `constitution`)")
    from rewards.constitution import load_constitution

    missing = [p.name for p in load_constitution(cai.principles).principles if not p.rubric]
    if missing:
        raise ValueError(f"reward.functions: judge asks each principle's rubric question; cai.principles "
                         f"{cai.principles or '(default)'} has none for {missing}")
