"""Checkpoint directory bookkeeping: atomic commit, marker, pruning, resolution."""

import pytest

from orchestrator.rl import checkpoint as ckpt


def _write(run_dir, step, keep=2):
    stage = ckpt.staging_dir(run_dir, step)
    (stage / "learner").mkdir()
    return ckpt.commit(run_dir, stage, step, {"step": step, "policy_version": step}, "cfg: 1\n", keep)


def test_commit_prunes_and_auto_resolves_newest(tmp_path):
    for step in (2, 4, 6):
        _write(tmp_path, step)
    names = [p.name for p in ckpt.complete_checkpoints(tmp_path)]
    assert names == ["step_000004", "step_000006"]
    assert ckpt.resolve("auto", tmp_path).name == "step_000006"
    assert ckpt.load_state(ckpt.resolve("auto", tmp_path)) == {"step": 6, "policy_version": 6}


def test_incomplete_checkpoint_is_never_used(tmp_path):
    _write(tmp_path, 2)
    stage = ckpt.staging_dir(tmp_path, 4)  # a save that died before its marker (e.g. disk full)
    (stage / "learner").mkdir()
    assert ckpt.resolve("auto", tmp_path).name == "step_000002"
    with pytest.raises(FileNotFoundError, match="COMPLETE"):
        ckpt.resolve(str(stage), tmp_path)


def test_export_needs_a_policy(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        ckpt.export_policy(tmp_path, tmp_path / "out")


def test_an_earlier_run_is_refused_and_overwrite_deletes_only_what_a_run_wrote(tmp_path):
    """A run dir with an earlier run's steps, summary, final policy or checkpoints is refused (naming `--resume
    auto` and `--overwrite`); a failed start (an empty metrics.jsonl, logs) is not an earlier run. `--overwrite`
    deletes the run's outputs and keeps the inputs beside them (a distill run's teacher data)."""
    from orchestrator.config import ConfigError

    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "logs").mkdir()
    ckpt.check_new_run_dir(tmp_path)  # nothing trained yet
    for make in (lambda: (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n'),
                 lambda: (tmp_path / "summary.json").write_text("{}"),
                 lambda: (tmp_path / "final").mkdir(),
                 lambda: _write(tmp_path, 2)):
        make()
        with pytest.raises(ConfigError, match=rf"run.dir={tmp_path} holds an earlier run .*`--resume auto`.*"
                                              r"`--overwrite` \(deletes that run's files\)"):
            ckpt.check_new_run_dir(tmp_path)
    (tmp_path / "distill_data.jsonl").write_text("{}\n")
    assert sorted(ckpt.clear_run(tmp_path)) == ["checkpoints", "final", "logs", "metrics.jsonl", "summary.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["distill_data.jsonl"]
    ckpt.check_new_run_dir(tmp_path)


def test_train_into_an_earlier_run_exits_2_before_starting_anything(tmp_path):
    """`fleetrl train` refuses the dir in one line before Ray or the model; `--resume` and `--overwrite` are one
    or the other."""
    from tests.conftest import cli

    run_dir = tmp_path / "run"
    _write(run_dir, 2)
    r = cli("train", f"run.dir={run_dir}", "trainer.total_steps=3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"run.dir={run_dir} holds an earlier run (checkpoints/)" in r.stderr and "--overwrite" in r.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]  # no config.yaml, no logs/
    r = cli("sft", f"run.dir={run_dir}", "--resume", "auto", "--overwrite")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr, r.stderr


def test_checkpoints_every_save_every_s_of_training(monkeypatch):
    """`trainer.save_every_s`: a checkpoint after the first step that ends that long after the last one (or the
    loop's start), beside `save_every`'s steps; none after a skipped (NaN) update."""
    from orchestrator.config import load_config
    from orchestrator.rl import driver
    from orchestrator.rl.driver import Run, StepOutcome

    clock = [0.0]
    monkeypatch.setattr(driver.time, "perf_counter", lambda: clock[0])
    run = Run.__new__(Run)  # the step bookkeeping alone: no task, tokenizer or fleet
    run.cfg = load_config(None, ["trainer.save_every_s=300", "trainer.save_every=4"])
    run.start_step, run.startup_s, run.t_config, run.last_save = 0, 1.0, 0.0, 0.0
    saved = []

    def save(next_step):
        saved.append(next_step)
        run.last_save = clock[0]
        return 0.1

    run.save_checkpoint = save
    skipped = {5}

    class Steps:
        def train_step(self, step):
            return StepOutcome({}, skipped_update=step in skipped)

    run.loop = Steps()
    run._metrics = type("NoMetrics", (), {"log": lambda self, m: None})()
    bad = 0
    for step, t in enumerate([100, 250, 310, 400, 620, 720, 730, 950]):
        clock[0] = t
        bad = run._train_step(step, {}, bad)
    # 310 s since the start: 3; step 4: save_every; 720 s (step 5) is due but its update was skipped, so the next
    # good step writes it (7); step 8: save_every again
    assert saved == [3, 4, 7, 8]
