"""RL that never leaves a model worse unnoticed: the pipeline's stage guard (warn, rollback or stop when a stage
lowers held-out accuracy past a margin), `pass: best` and `trainer.keep_best` (the best evaluated policy kept as
`best/`, not the last)."""

import json
from pathlib import Path

import pytest

from orchestrator.config import ConfigError
from orchestrator.recipes.pipeline import DEFAULT_GUARD, Stage, check_stage, hand_on, load_guard, load_recipe
from tests.conftest import fleetrl


def _stage(tmp_path: Path, index: int, first: float | None, last: float | None, model: str, best=None) -> Stage:
    from orchestrator.config import load_config

    cfg = load_config(None, [f"run.dir={tmp_path / f'0{index}-s{index}'}", f"model.path={model}"])
    st = Stage(index, f"s{index}", "rl", cfg)
    st.dir.mkdir(parents=True, exist_ok=True)
    (st.dir / "summary.json").write_text(json.dumps({"eval_accuracy_first": first, "eval_accuracy_last": last,
                                                     "best": best}))
    return st


@pytest.mark.parametrize("action", ["warn", "rollback", "stop"])
def test_a_stage_that_lowers_accuracy_past_the_margin_is_warned_rolled_back_or_stopped(tmp_path, action, capsys):
    st = _stage(tmp_path, 1, 0.80, 0.60, "/models/start")
    nxt = _stage(tmp_path, 2, None, None, str(st.dir / "final"))
    row = {"model": str(st.dir / "final")}
    go_on = check_stage(st, row, {"action": action, "margin": 0.05})
    assert go_on == (action != "stop") and row["guard"] == {"start": 0.8, "end": 0.6, "margin": 0.05, "action": action}
    assert "lowered held-out accuracy 0.800 -> 0.600" in capsys.readouterr().out
    hand_on(st, row["model"], [st, nxt])
    assert nxt.cfg.model.path == ("/models/start" if action == "rollback" else str(st.dir / "final"))
    # within the margin, or no evals: nothing happens
    for first, last in ((0.80, 0.78), (None, None)):
        row = {"model": "x"}
        assert check_stage(_stage(tmp_path, 3, first, last, "/m"), row, DEFAULT_GUARD) and "guard" not in row


def test_pass_best_hands_on_best_and_is_checked_at_load(tmp_path):
    st = _stage(tmp_path, 1, 0.5, 0.4, "/m", best={"metric": "eval/accuracy", "value": 0.7, "step": 10})
    st.hands = "best"
    row = {"model": str(st.dir / "final")}
    assert check_stage(st, row, {"action": "stop", "margin": 0.0}) and row["model"] == str(st.dir / "best")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {{run: {{dir: {tmp_path / 'p'}}}}}\nstages:\n  - {{name: a, kind: rl, pass: best}}\n")
    with pytest.raises(ConfigError, match="trainer.keep_best"):
        load_recipe(recipe, [])
    assert load_recipe(recipe, ["trainer.keep_best=eval/accuracy"])[0].hands == "best"
    for bad in ({"action": "explode"}, {"margin": -1}, {"margin": "x"}, {"other": 1}):
        with pytest.raises(ConfigError, match="'guard' must be"):
            load_guard({"guard": bad}, recipe)
    with pytest.raises(ConfigError, match="eval metric"):
        from orchestrator.config import load_config

        load_config(None, ["trainer.keep_best=loss"])


DESTRUCTIVE = """base:
  run: {dir: %s}
guard: {action: rollback, margin: 0.05}
stages:
  - {name: good, kind: rl,
     overrides: {trainer.total_steps: 4, trainer.keep_best: eval/accuracy, trainer.eval_every: 2, learner.lr: 1.0e-4}}
  - {name: bad, kind: rl, overrides: {trainer.total_steps: 2, trainer.eval_every: 2, learner.lr: 0.05}}
  - {name: after, kind: rl, overrides: {trainer.total_steps: 0, trainer.eval_every: 1}}
"""


@pytest.mark.e2e
def test_the_guard_rolls_back_a_destructive_stage_and_keep_best_keeps_the_best(tmp_path):
    """Only this test guards the stage guard and keep_best with real stages on the shared fleet: a stage at lr 0.05
    wrecks the policy, the guard rolls back (the next stage trains from what the wrecked stage was handed), and the
    first stage's best/ is its best evaluated policy, not its last."""
    run_dir = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(DESTRUCTIVE % run_dir)
    proc = fleetrl("pipeline", "-c", str(recipe), "data.eval_size=64", "data.prompts_per_step=4",
                   "rollout.group_size=4", "rollout.num_workers=1", "learner.num_ranks=1", "learner.zero_stage=0")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = json.loads((run_dir / "summary.json").read_text())["stages"]
    bad = rows[1]
    assert bad["guard"]["action"] == "rollback" and bad["guard"]["end"] < bad["guard"]["start"] - 0.05, rows
    assert "stage 2 bad lowered held-out accuracy" in proc.stdout
    handed = rows[0]["model"]
    assert bad["model"] == handed == str(run_dir / "01-good" / "final")
    assert f"path: {handed}" in (run_dir / "03-after" / "stage.yaml").read_text()
    # the third stage evaluates what it was handed: the good stage's final accuracy, not the wrecked one's
    after = json.loads((run_dir / "03-after" / "summary.json").read_text())
    assert after["eval_accuracy_first"] > bad["guard"]["end"] + 0.05, after
    good = json.loads((run_dir / "01-good" / "summary.json").read_text())
    evals = [json.loads(line) for line in (run_dir / "01-good" / "metrics.jsonl").read_text().splitlines()]
    evals = [(m["step"], m["eval/accuracy"]) for m in evals if "eval/accuracy" in m]
    best_step, best_value = max(evals, key=lambda e: (e[1], -e[0]))
    assert good["best"] == {"metric": "eval/accuracy", "value": best_value, "step": best_step}, (good["best"], evals)
    assert (run_dir / "01-good" / "best" / "config.json").exists()
