"""Config sections of process supervision and test-time search (`prm.*`, `search.*`), part of the one config
tree (:class:`orchestrator.config.FleetConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from orchestrator.config.section import Section


class PRMSection(Section):
    """Process supervision (docs/search.md): Monte-Carlo step labels (`fleetrl prm label`), PRM training
    (`fleetrl prm train`), PRM scores as process rewards (`algorithm.name: grpo_process` or `ppo` with `path` set)
    and PRM-guided search (`fleetrl eval --search`)."""

    path: str | None = None
    """A trained PRM (the `final/` of `fleetrl prm train`): served by the `prm-i` actors for process RL and search."""
    orm_path: str | None = None
    """An outcome reward model in the same layout (`fleetrl prm train prm.target=outcome`): `orm_best_of_n`."""
    labels: str | None = None
    """`fleetrl prm train`: the JSONL of step labels written by `fleetrl prm label` (or `--labels`)."""
    target: Literal["soft", "hard", "outcome"] = "soft"
    """What the PRM learns: `soft` (each step's Monte-Carlo success rate), `hard` (1 when any continuation
    succeeded), `outcome` (the solution's final correctness on its last step only: an ORM)."""
    tag: str = "+"
    """The token put after every step; its probability there is the step's score (one token of the tokenizer)."""
    prompts: int = Field(64, ge=1, le=10**6)
    """`fleetrl prm label`: training prompts whose solutions are labelled."""
    samples: int = Field(4, ge=1, le=1024)
    """`fleetrl prm label`: solutions sampled per prompt."""
    continuations: int = Field(8, ge=1, le=1024)
    """`fleetrl prm label`: K, completions sampled from every step prefix (Math-Shepherd's N)."""
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """`fleetrl prm train`: share of the labelled solutions held out for `prm/auc` (split by prompt)."""
    process_weight: float = Field(1.0, ge=0.0)
    """Process RL: weight of the PRM's step scores beside the outcome reward on the last step."""
    num_workers: int = Field(1, ge=1, le=1024)
    """`prm-i` actors serving the PRM."""
    num_cpus: float = Field(0.25, ge=0.0)
    """Ray CPUs reserved by each `prm-i` actor."""
    batch_size: int = Field(64, ge=1, le=65536)
    """Solutions per PRM forward pass."""


class SearchSection(Section):
    """`fleetrl eval --search`: settings of the step-level methods (docs/search.md)."""

    expansions: int = Field(4, ge=1, le=1024)
    """`prm_beam`: next steps sampled per beam; `mcts`: children per node."""
    max_steps: int = Field(12, ge=1, le=1000)
    """Steps a beam or tree path may take before it is cut."""
    step_tokens: int = Field(16, ge=1, le=65536)
    """Most tokens of one step."""
    mcts_c: float = Field(1.0, ge=0.0)
    """c of UCB = Q + c * sqrt(ln N(s) / N(s, a))."""
    mcts_value: Literal["prm", "rollout"] = "rollout"
    """MCTS leaf value: the PRM's score of a complete rollout sampled from the new step (aggregated over its
    steps), or (`prm`) the PRM's score of the new step alone."""
    aggregation: Literal["min", "last", "prod"] = "min"
    """How step scores rank complete solutions (beam, mcts, revision); `prm_best_of_n:<agg>` picks its own."""
    revision_threshold: float = Field(0.5, ge=0.0, le=1.0)
    """`revision`: a step the PRM scores below this is a mistake; the solution is redone from the step before."""
