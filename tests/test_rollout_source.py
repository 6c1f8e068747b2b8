"""The rollout sources (orchestrator/rl/rollout_source.py): one seam for where every sampling loop's batches come
from. Unit: rollout.mode is compared nowhere but in the source registry and the config's validators; the source of
a config; each objective says whether it may train on older policies' samples. End to end (shared fleet): online
DPO and RFT run in one_step_off and async."""

import ast
import json
from pathlib import Path

import pytest

from orchestrator.config import ConfigError, load_config
from orchestrator.rl.rollout_source import (
    SOURCES,
    AsyncSource,
    OneStepOffSource,
    RolloutSource,
    SyncSource,
    import_source,
    source_class,
)
from tests.conftest import fleetrl

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "workers", "learner", "rewards", "common")
ALLOWED = ("orchestrator/config/", "orchestrator/rl/rollout_source.py")
MODES = {"sync", "one_step_off", "async"}


class MyRollouts(SyncSource):
    """A user's source (``rollout.source``)."""


def mode_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing something named ``mode`` (``cfg.rollout.mode``, ``r.mode``) or comparing with a mode's
    name."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = any(isinstance(x, ast.Attribute) and x.attr == "mode" for x in operands)
        names = {x.value for x in ast.walk(node) if isinstance(x, ast.Constant) and isinstance(x.value, str)}
        if named or names & MODES:
            lines.append(node.lineno)
    return lines


def test_rollout_mode_is_compared_only_in_the_source_registry_and_the_config_validators():
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED):
                continue
            lines = mode_comparisons(ast.parse(path.read_text()))
            if lines:
                found[rel] = lines
    assert not found, f"rollout.mode compared outside the rollout sources: {found}"
    # the check sees a comparison where there is one
    assert mode_comparisons(ast.parse("if cfg.rollout.mode == 'async': pass")) == [1]
    assert mode_comparisons(ast.parse("busy = r.mode in ('sync', 'x')")) == [1]


def test_each_mode_has_its_source_and_a_users_source_is_one_key():
    assert SOURCES == {"sync": SyncSource, "one_step_off": OneStepOffSource, "async": AsyncSource}
    for mode, cls in SOURCES.items():
        assert source_class(load_config(None, [f"rollout.mode={mode}"])) is cls
    assert [c.overlaps_learner for c in SOURCES.values()] == [False, True, True]
    cfg = load_config(None, ["rollout.source=tests.test_rollout_source:MyRollouts"])
    assert source_class(cfg) is MyRollouts and issubclass(MyRollouts, RolloutSource)
    with pytest.raises(ValueError, match=r"rollout.source='tests.test_rollout_source:nope'.*cannot import"):
        import_source("tests.test_rollout_source:nope")
    with pytest.raises(ValueError, match="not a subclass of .*RolloutSource"):
        import_source("pathlib:Path")


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_each_objective_says_whether_it_trains_on_older_policies_samples(mode):
    for algo in ("dpo", "sft"):  # online DPO, RFT's objective: no importance weight needed
        assert load_config(None, [f"algorithm.name={algo}", f"rollout.mode={mode}"]).rollout.mode == mode
    assert load_config(None, [f"rollout.mode={mode}"]).algorithm.tis_cap == 2.0
    with pytest.raises(ConfigError, match=r"algorithm.name=grpo needs the truncated-IS correction.*tis_cap"):
        load_config(None, [f"rollout.mode={mode}", "algorithm.tis_cap=null"])


RUNS = [("dpo", "one_step_off"), ("rft", "one_step_off"), ("dpo", "async"), ("rft", "async")]


@pytest.mark.e2e
@pytest.mark.parametrize("kind,mode", RUNS, ids=[f"{k}-{m}" for k, m in RUNS])
def test_online_dpo_and_rft_train_in_every_rollout_mode(tmp_path, kind, mode):
    """Only these runs guard online DPO's and RFT's batches from the one_step_off and async sources: two steps,
    each on samples drawn by the policy before the last push (one_step_off: step 1 trains on version 0's batch,
    generated while step 0 trained), the weights pushed every step, the async stream's accounting whole."""
    run_dir = tmp_path / "run"
    common = [f"run.dir={run_dir}", f"rollout.mode={mode}", "data.prompts_per_step=4", "data.eval_size=8",
              "rollout.num_workers=1", "learner.num_ranks=1", "learner.zero_stage=0", "learner.lr=3e-4"]
    if kind == "dpo":
        proc = fleetrl("train", "algorithm.name=dpo", "algorithm.min_reward_gap=0.1", "trainer.total_steps=2",
                       "trainer.eval_every=0", *common)
    else:
        proc = fleetrl("rft", "--rounds", "2", *common)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/samples" in r]
    assert [r["step"] for r in steps] == [0, 1] and all(r["rollout/samples"] == 32 for r in steps)
    pushed = [r for r in steps if "weight_sync/logprob_max_diff" in r]
    assert pushed and all(r["weight_sync/logprob_max_diff"] < 1e-3 for r in pushed)
    assert all(r["rollout/staleness_max"] <= 1 for r in steps)
    if mode == "one_step_off":
        assert [r["rollout/policy_version_min"] for r in steps] == [0, 0]
        assert steps[1]["rollout/staleness_max"] == (1 if steps[0] in pushed else 0)
    else:
        assert steps[-1]["async/trained"] == 8 and steps[-1]["async/submitted"] == \
            8 + steps[-1]["async/in_flight"] + steps[-1]["async/dropped_stale"]
