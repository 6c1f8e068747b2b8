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
