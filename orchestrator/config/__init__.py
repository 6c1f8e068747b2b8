"""One pydantic tree for a whole fleetrl run.

Defaults are the embedded default run (the small arithmetic model on 2 CPU cores). Every field has a
docstring; bounds are validated at load time, and cross-field checks explain themselves. The algorithm is
chosen once, here, by the discriminated union on ``algorithm.name``.

Load a YAML file and apply dotted overrides with :func:`load_config`; errors come back as
:class:`ConfigError` whose message names the key, what was given, and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from orchestrator.config.algorithm_sections import (  # noqa: F401 - re-exported: the algorithm sections are part of the config
    ALGORITHM_SECTIONS,
    AlgorithmConfig,
    DrGRPOConfig,
    GDPOConfig,
    GRPOConfig,
    GRPOProcessConfig,
    LossConfig,
    OnPolicyDistillConfig,
    PPOConfig,
    ReinforcePPBaselineConfig,
    ReinforcePPConfig,
    RewardCondition,
    RLOOConfig,
)
from orchestrator.config.cai import CAISection, check_judge_reward
from orchestrator.config.env import EnvConfig
from orchestrator.config.lora import check_lora
from orchestrator.config.run_sections import (  # noqa: F401 - re-exported: the sections are part of the config
    CALC_MODEL_PATH,
    CHAIN_MODEL_PATH,
    EMBEDDED_MODEL_PATH,
    EMBEDDED_MODELS,
    THINK_MODEL_PATH,
    DataConfig,
    DistillSection,
    LearnerConfig,
    ModelConfig,
    RewardConfig,
    RewardFunctionSpec,
    RewardModelConfig,
    RFTConfig,
    RolloutConfig,
    RunConfig,
    SFTSection,
    TrainerConfig,
)
from orchestrator.config.search import PRMSection, SearchSection
from orchestrator.config.section import Section


class FleetConfig(Section):
    """The whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=GRPOConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    rft: RFTConfig = Field(default_factory=RFTConfig)
    sft: SFTSection = Field(default_factory=SFTSection)
    distill: DistillSection = Field(default_factory=DistillSection)
    env: EnvConfig = Field(default_factory=EnvConfig)
    prm: PRMSection = Field(default_factory=PRMSection)
    search: SearchSection = Field(default_factory=SearchSection)
    cai: CAISection = Field(default_factory=CAISection)

    @property
    def engine_dtype(self) -> str:
        """The rollout engines' dtype (``rollout.dtype``, where `auto` is ``model.dtype``)."""
        return self.model.dtype if self.rollout.dtype == "auto" else self.rollout.dtype

    @model_validator(mode="before")
    @classmethod
    def _default_algorithm_name(cls, data):
        """An algorithm section without ``name`` is the default algorithm's (``algorithm.kl_coef=0.1`` alone)."""
        algo = data.get("algorithm") if isinstance(data, dict) else None
        if isinstance(algo, dict) and "name" not in algo:
            data = {**data, "algorithm": {"name": GRPOConfig.model_fields["name"].default, **algo}}
        return data

    @model_validator(mode="after")
    def _check_batch_split(self) -> FleetConfig:
        seqs = self.data.prompts_per_step * self.rollout.group_size
        per_rank, rem = divmod(seqs, self.learner.num_ranks * self.learner.num_minibatches)
        if rem:
            raise ValueError(
                f"data.prompts_per_step * rollout.group_size = {seqs} sequences must split evenly into "
                f"learner.num_ranks * learner.num_minibatches = "
                f"{self.learner.num_ranks * self.learner.num_minibatches} shards"
            )
        if per_rank % min(self.learner.micro_batch_size, per_rank):
            raise ValueError(
                f"each rank's shard of {per_rank} sequences must split evenly into "
                f"learner.micro_batch_size = {self.learner.micro_batch_size}"
            )
        return self

    @model_validator(mode="after")
    def _check_row_pairs(self) -> FleetConfig:
        """A (chosen, rejected) objective's batch geometry: every learner rank gets whole pairs."""
        rows = self.data.prompts_per_step * self.rollout.group_size
        if self.algorithm.objective in ("dpo", "bradley_terry") and (rows // self.learner.num_ranks) % 2:
            raise ValueError(f"algorithm.name={self.algorithm.name} trains row pairs: data.prompts_per_step * "
                             f"rollout.group_size ({rows}) must give each of learner.num_ranks="
                             f"{self.learner.num_ranks} ranks an even number of rows")
        return self

    @model_validator(mode="after")
    def _check_async(self) -> FleetConfig:
        r = self.rollout
        if r.mode == "one_step_off" and r.max_staleness < 1:
            raise ValueError("rollout.mode=one_step_off trains on samples one policy version old: it needs "
                             f"rollout.max_staleness >= 1 (got {r.max_staleness})")
        if r.mode != "sync" and r.max_staleness and not self.algorithm.accepts_stale_samples():
            raise ValueError(f"rollout.mode={r.mode} with rollout.max_staleness={r.max_staleness} trains on older "
                             f"policies' samples: algorithm.name={self.algorithm.name} needs the truncated-IS "
                             "correction for them, set algorithm.tis_cap (e.g. 2.0), not null")
        if r.mode == "async":
            if self.env.multi_turn:
                raise ValueError("rollout.mode=async streams single-turn completions: multi-turn episodes "
                                 f"(env.name={self.env.name}, env.agent={self.env.agent}) run in sync or "
                                 "one_step_off mode")
            if r.dynamic_sampling:
                raise ValueError("rollout.mode=async takes groups as they complete: rollout.dynamic_sampling "
                                 "(DAPO's resampling rounds) is a sync/one_step_off option")
        return self

    @model_validator(mode="after")
    def _apply_run_seed(self) -> FleetConfig:
        """``run.seed`` seeds the prompt stream, the sampling and the learner; a section seed that says otherwise is
        a contradiction, not an override."""
        seed = self.run.seed
        if seed is None:
            return self
        for name in ("data", "rollout", "trainer"):
            section = getattr(self, name)
            if "seed" in section.model_fields_set and section.seed != seed:
                raise ValueError(f"run.seed={seed} sets data.seed, rollout.seed and trainer.seed; {name}.seed="
                                 f"{section.seed} contradicts it (set one of the two)")
            section.seed = seed
        return self

    @model_validator(mode="after")
    def _check_teacher(self) -> FleetConfig:
        """On-policy distillation's advantage compares the student's sampled logprobs with the teacher's at
        temperature 1: the student must sample its own distribution, untempered and untruncated."""
        r = self.rollout
        if self.algorithm.uses_teacher and (r.temperature != 1.0 or r.top_p != 1.0):
            raise ValueError(f"algorithm.name={self.algorithm.name} compares the student's logprobs with the "
                             "teacher's at temperature 1: it needs rollout.temperature=1.0 and rollout.top_p=1.0 "
                             f"(got {r.temperature} and {r.top_p})")
        return self

    @model_validator(mode="after")
    def _check_judge(self) -> FleetConfig:
        check_judge_reward(self.reward.functions, self.cai, self.data.prompt_format)
        return self

    @property
    def judge_spec(self) -> RewardFunctionSpec | None:
        """The `judge` entry of `reward.functions`, if any."""
        from rewards.judge import NAME

        return next((f for f in self.reward.functions if f.name == NAME), None)

    @model_validator(mode="after")
    def _check_lora(self) -> FleetConfig:
        check_lora(self.learner.lora, self.model.path)
        return self

    @property
    def uses_reference(self) -> bool:
        """The learner keeps a frozen reference model (for a KL term, or to log KL)."""
        return self.algorithm.needs_reference() or self.learner.log_kl

    @property
    def uses_process_rewards(self) -> bool:
        """Step rewards reach the advantages: ``grpo_process`` always, PPO when a PRM is configured."""
        return self.algorithm.uses_step_rewards or bool(self.prm.path and self.algorithm.uses_critic)

    @property
    def sequences_per_step(self) -> int:
        return self.data.prompts_per_step * self.rollout.group_size

    def micro_batches_per_rank(self) -> int:
        """Gradient-accumulation micro-batches per rank and optimizer step."""
        per_rank = self.sequences_per_step // (self.learner.num_ranks * self.learner.num_minibatches)
        return max(1, per_rank // self.learner.micro_batch_size)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and what is allowed."""


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            parent = _section_for(tuple(e["loc"][:-1]))
            allowed = ", ".join(parent.model_fields) if parent else "?"
            owners = [m.model_fields["name"].default for m in ALGORITHM_SECTIONS if e["loc"][-1] in m.model_fields]
            mine = parent in ALGORITHM_SECTIONS and owners
            hint = f"; it is a setting of algorithm.name={'|'.join(owners)}" if mine else ""
            lines.append(f"  {key}: unknown key (allowed here: {allowed}){hint}")
        elif e["type"] == "union_tag_invalid" or not e["loc"]:  # a cross-field check names its keys itself
            lines.append(f"  {key}: {e['msg']}")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _section_for(path: tuple) -> type[BaseModel] | None:
    if len(path) == 2 and path[0] == "algorithm":  # the union's tag ('grpo') is in the location
        return _union_member(FleetConfig, path[1], path)
    cls: type[BaseModel] = FleetConfig
    for part in path:
        if not isinstance(part, str) or part not in cls.model_fields:
            return None if not isinstance(part, str) else _union_member(cls, part, path)
        ann = cls.model_fields[part].annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _union_member(cls: type[BaseModel], part: str, path: tuple) -> type[BaseModel] | None:
    """Pydantic puts the union tag ('grpo') into the error location; map it back to the member class."""
    for member in ALGORITHM_SECTIONS:
        if member.model_fields["name"].default == part:
            return member
    return None


def apply_override(tree: dict, dotted: str) -> None:
    """Apply one `a.b.c=value` override to a nested dict; the value is parsed as YAML (safe loader)."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} is not of the form key.path=value")
    key, raw = dotted.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is a value, not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {dotted!r}: value is not valid YAML: {e}") from e


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> FleetConfig:
    """Read an optional YAML file, apply dotted overrides, validate."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
        try:
            from rewards.datasets import yaml_load

            tree = yaml_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(tree).__name__}")
    for ov in overrides:
        apply_override(tree, ov)
    if overrides:
        source += " + overrides " + " ".join(overrides)
    try:
        return FleetConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def dump_config(cfg: FleetConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
