"""Recipes end to end with real actors: offline DPO on a pairs file, and a 3-stage pipeline (sft -> rl -> rft) that
is killed during stage 2 and rerun: stage 1 is not repeated and stage 2 resumes from its checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from orchestrator.rl import checkpoint as ckpt
from rewards.tasks import ArithmeticTask
from tests.conftest import fleetrl, shared_ray_env, subprocess_env
from tests.test_e2e import ROOT

SMALL = ["data.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=16", "rollout.num_workers=1",
         "learner.num_ranks=1", "learner.zero_stage=0"]


def _env() -> dict:
    env = subprocess_env(RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1")
    env.pop("RAY_ADDRESS", None)
    env.update(shared_ray_env())
    return env


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_offline_dpo_on_a_pairs_file_raises_the_preference_accuracy(tmp_path):
    """16 pairs of the arithmetic task: the right sum is chosen, a sum off by one or ten rejected. Six DPO steps
    (each a shuffled pass over the 16 pairs) through `fleetrl train algorithm.name=dpo`: the implicit-reward
    preference accuracy and margin rise, and the policy itself (not only relative to the reference) comes to
    prefer the chosen answers more."""
    task = ArithmeticTask()
    prompts = task.train_batch(0, 16)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": p.text, "chosen": p.metadata["answer"],
                                         "rejected": str(int(p.metadata["answer"]) + (1 if i % 2 else 10))}) + "\n"
                             for i, p in enumerate(prompts)))
    run_dir = tmp_path / "dpo"
    proc = fleetrl("train", "algorithm.name=dpo", f"algorithm.pairs={pairs}", "algorithm.beta=0.5", "learner.lr=1e-4",
                   "trainer.total_steps=6", "trainer.eval_every=6", f"run.dir={run_dir}", *SMALL,
                   "data.prompts_per_step=8")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [r for r in _rows(run_dir) if "dpo/loss" in r]
    assert len(rows) == 6 and all(r["dpo/pairs"] == 16 for r in rows)
    logs = {p.name for p in (run_dir / "logs").iterdir()}  # engines for the evals; no reward actor (no sampling)
    assert "rollout-0.log" in logs and not any(n.startswith("reward-") for n in logs), logs
    first, last = rows[0], rows[-1]
    assert first["dpo/preference_accuracy"] == 0.0 and first["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert last["dpo/preference_accuracy"] >= 0.75 and last["dpo/reward_margin"] > 0.1
    assert last["dpo/loss"] < first["dpo/loss"]
    gap = [r["dpo/chosen_logp"] - r["dpo/rejected_logp"] for r in (first, last)]
    assert gap[1] > gap[0]
    assert (run_dir / "final" / "config.json").exists()


RECIPE = """base:
  run: {dir: %s}
stages:
  - {name: warm, kind: sft, cold_start: 64, overrides: {trainer.total_steps: 2, learner.lr: 1.0e-3}}
  - {name: rl, kind: rl, overrides: {trainer.total_steps: 6, trainer.save_every: 1}}
  - {name: rft, kind: rft, overrides: {trainer.total_steps: 1, rft.threshold: 0.0}}
"""


@pytest.mark.own_fleet  # mostly processes of its own (the killed run, the stage alone); its rerun starts a fleet server
@pytest.mark.e2e
def test_pipeline_killed_in_stage_two_resumes_without_repeating_stage_one(tmp_path):
    run_dir = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE % run_dir)
    cmd = [sys.executable, "-m", "orchestrator", "pipeline", "-c", str(recipe), "trainer.eval_every=0",
           "data.eval_size=16", "data.prompts_per_step=4", "rollout.group_size=4", "rollout.num_workers=1",
           "learner.num_ranks=1", "learner.zero_stage=0"]
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    stage2 = run_dir / "02-rl"
    deadline = time.time() + 480
    while time.time() < deadline and proc.poll() is None and len(ckpt.complete_checkpoints(stage2)) < 2:
        time.sleep(0.5)
    assert proc.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the pipeline and the stage-2 process, mid-stage
    proc.wait()
    summary = json.loads((run_dir / "summary.json").read_text())["stages"]
    assert [s["status"] for s in summary] == ["finished", "running", "pending"]
    killed_at = ckpt.complete_checkpoints(stage2)[-1]

    again = fleetrl(*cmd[3:], timeout=600)  # the rerun, on the session's fleet
    assert again.returncode == 0, (again.stdout + again.stderr)[-6000:]
    assert "stage 1 warm finished already" in again.stdout and "resuming from" in again.stdout
    summary = json.loads((run_dir / "summary.json").read_text())["stages"]
    assert [s["status"] for s in summary] == ["finished"] * 3
    assert [s["attempts"] for s in summary] == [1, 2, 1]
    assert summary[1]["resumed_from"] is not None and int(summary[1]["resumed_from"].rsplit("_", 1)[1]) >= \
        int(killed_at.name.rsplit("_", 1)[1])
    assert summary[1]["model"] == str(stage2 / "final") and (stage2 / "final" / "config.json").exists()
    steps = [r["step"] for r in _rows(stage2)]
    assert steps == list(range(7))  # every step once: the resumed run continued the stage's metrics
    # the SFT stage without evals started the learner group alone: no engine, reward actor or probe
    assert not [p.name for p in (run_dir / "01-warm" / "logs").iterdir() if p.name.startswith(("rollout-", "reward-"))]
    stage3 = (run_dir / "03-rft" / "stage.yaml").read_text()
    assert f"path: {stage2 / 'final'}" in stage3
    assert all(s["model"] and s["seconds"] > 0 for s in summary)
    # stage 3 ran on the fleet stage 2 left (the learner ranks loaded 02-rl/final in place, the engines
    # got its weights, the reward actor stayed): the same round alone, on a fleet of its own, gives the same numbers
    stage3_log = (run_dir / "03-rft" / "logs" / "driver.log").read_text()
    assert "fleet served a new run" in stage3_log and "kept ['learner', 'reward', 'rollout']" in stage3_log
    alone = tmp_path / "rft-alone"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "rft", "-c", str(run_dir / "03-rft" / "stage.yaml"),
                           "--rounds", "1", f"run.dir={alone}"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    keys = ("rft/kept", "reward/mean", "train/accuracy", "actor/loss", "tokens_generated",
            "weight_sync/logprob_max_diff")
    served, fresh = _rows(run_dir / "03-rft")[0], _rows(alone)[0]
    assert {k: served.get(k) for k in keys} == pytest.approx({k: fresh.get(k) for k in keys}, abs=1e-6)
    assert served["rft/kept"] > 0  # an update happened (threshold 0 keeps every distinct sample): losses compared
    from safetensors.torch import load_file  # and the update itself: a fresh optimizer and schedule on the reused ranks

    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (run_dir / "03-rft", alone))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


@pytest.mark.e2e
def test_distill_keeps_only_the_teachers_verified_answers_and_fine_tunes_the_student(tmp_path):
    """Teacher: the embedded base model (about 20% greedy accuracy, more with G samples); student: the same base.
    The written data holds only correct answers of training prompts; the report has teacher accuracy, kept
    fraction and the student's held-out accuracy before and after."""
    from rewards.functions import math_reward

    run_dir = tmp_path / "distill"
    proc = fleetrl("distill", "distill.teacher=.fleetrl/models/arith-base", "distill.prompts=32",
                   "trainer.total_steps=2", "trainer.eval_every=2", f"run.dir={run_dir}", *SMALL)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads((run_dir / "distill.json").read_text())
    assert report["prompts"] == 32 and report["samples"] == 32 * 4
    assert 0 < report["kept"] <= report["samples"] and 0 < report["teacher_accuracy"] <= 1
    assert report["kept_fraction"] == report["kept"] / report["samples"]
    assert report["student_accuracy_before"] is not None and report["student_accuracy_after"] is not None
    rows = [json.loads(x) for x in (run_dir / "distill_data.jsonl").read_text().splitlines()]
    assert len(rows) == report["kept"]
    for r in rows:
        a, b = r["prompt"].rstrip("=").split("+")
        assert math_reward(r["prompt"], r["response"], {"answer": str(int(a) + int(b))}) == 1.0
    assert (run_dir / "final" / "config.json").exists()
    proc = fleetrl("distill", "distill.teacher=/nonexistent", f"run.dir={tmp_path / 'bad'}", timeout=120)
    assert proc.returncode == 2 and "distill.teacher: '/nonexistent' is not a model directory" in proc.stderr
    assert not (tmp_path / "bad").exists()
