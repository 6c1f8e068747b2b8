"""Killed rollout and reward actors are replaced mid-run and the step still completes with the full batch;
a dead learner rank stops the run with a message that says how to resume. Real Ray, vLLM, DeepSpeed."""

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import fleetrl, shared_ray_env, subprocess_env
from tests.test_e2e import ROOT, train

DRIVER = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pathlib import Path
    import ray
    from orchestrator.config import load_config
    from orchestrator.loops import train as run_training

    run_dir = Path(sys.argv[1])
    cfg = load_config(None, [f"run.dir={run_dir}", "trainer.total_steps=8", "trainer.eval_every=0",
                             "rollout.num_workers=2", "learner.num_ranks=1", "learner.zero_stage=0"])
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)  # the session's head (tests/conftest.py)

    def rows_written(n):
        metrics = run_dir / "metrics.jsonl"
        while not metrics.exists() or len(metrics.read_text().splitlines()) < n:
            time.sleep(0.05)

    def killer():
        rows_written(2)  # after step 1: a rollout and the reward actor die
        ray.kill(ray.get_actor("rollout-1"), no_restart=True)
        pid = ray.get(ray.get_actor("reward-0").stats.remote())["pid"]
        os.kill(pid, signal.SIGKILL)
        rows_written(4)  # steps 2 and 3 ran on their replacements; then the learner dies
        ray.kill(ray.get_actor("learner-0"), no_restart=True)

    threading.Thread(target=killer, daemon=True).start()
    try:
        run_training(cfg)
        print("FINISHED", flush=True)
    except Exception as e:
        print("FAILED", type(e).__name__, e, flush=True)
""")


def _run(tmp_path):

    env = subprocess_env(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", **shared_ray_env())
    r = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return r.stdout, rows


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_killed_actors_are_replaced_and_a_dead_learner_stops_the_run(tmp_path):
    """Guards fault handling in one run: a rollout and the reward actor killed after step 1 are replaced and
    steps 2-3 still get their full batches with the current weights; then a dead learner rank stops the run with
    a message that says how to resume."""
    out, rows = _run(tmp_path)
    assert "FAILED LearnerDied" in out and "resume" in out, out[-3000:]
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) >= 4
    for r in train:  # every step had its full batch, each prompt once
        assert r["rollout/samples"] == 16 * 8 and r["rollout/unique_prompts"] == 16
        assert r["rollout/logprob_gap_max"] < 1e-3  # replacement engines generated with the current weights
        assert r["weight_sync/logprob_max_diff"] < 1e-3  # and every push after it arrived
    assert train[1]["faults/rollout_restarts"] == 0 and train[0]["faults/reward_restarts"] == 0
    assert train[3]["faults/rollout_restarts"] == 1 and train[3]["faults/reward_restarts"] == 1
    print("recovery seconds: rollout", train[3]["faults/rollout_recovery_s"], "reward",
          train[3]["faults/reward_recovery_s"], "; step times", [round(r["time/step_s"], 2) for r in train])


def nan_reward(prompt, completion, metadata):
    """A reward function gone wrong: a finite Python float beyond float32's range, which the advantages (float32)
    hold as inf, making NaN advantages, losses and gradients. (A NaN or an infinity itself is refused where the reward
    function returns it: tests/test_finite_rewards.py.)"""
    return 1e39


@pytest.mark.e2e
@pytest.mark.parametrize("ranks,zero_stage",
                         [(1, 0), pytest.param(2, 2, marks=pytest.mark.learner(ranks=2, zero_stage=2))])
def test_nan_steps_are_skipped_then_the_run_stops(tmp_path, ranks, zero_stage):
    r = fleetrl("train", f"run.dir={tmp_path}", "trainer.total_steps=6", "trainer.eval_every=0",
                "trainer.max_bad_steps=2", "trainer.save_every=1", "rollout.num_workers=1",
                f"learner.num_ranks={ranks}", f"learner.zero_stage={zero_stage}", "learner.log_kl=true",
                "reward.functions=[{name: 'tests.test_faults:nan_reward'}]")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "2 steps in a row had a NaN/Inf" in r.stderr and "Last good checkpoint: none" in r.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["actor/skipped_step_frac"] for row in rows] == [1.0, 1.0]
    assert rows[-1]["train/bad_steps_in_a_row"] == 2
    # the skipped updates left the policy untouched: it still equals the reference exactly
    assert rows[1]["kl"] == 0.0 and rows[1]["weight_sync/logprob_max_diff"] < 1e-3
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").glob("step_*"))


def failing_reward(prompt, completion, metadata):
    """Fails on what the policy writes; the load-time check's sample (the reference answer) passes, so the
    failure happens inside the reward actor, which is what the test below is about."""
    if completion == metadata["answer"]:
        return 1.0
    raise ValueError("this reward function always fails")


@pytest.mark.e2e
def test_a_failing_actor_is_named_on_the_console_with_its_log(tmp_path):
    proc = fleetrl("train", f"run.dir={tmp_path}", "trainer.total_steps=2", "trainer.eval_every=0",
                   "rollout.num_workers=1", "learner.num_ranks=1", "learner.zero_stage=0", "reward.strict=true",
                   "reward.functions=[{name: 'tests.test_faults:failing_reward'}]")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    log = tmp_path / "logs" / "reward-0.log"
    assert f"fleetrl: reward-0 (its log: {log}) failed: RewardFunctionError" in proc.stderr, proc.stderr
    assert "this reward function always fails" in proc.stderr and "Traceback" not in proc.stderr
    assert "ValueError: this reward function always fails" in log.read_text()  # the traceback is in its log
    assert f"driver log: {tmp_path / 'logs' / 'driver.log'}" in proc.stderr


def broken_in_the_actors(prompt, completion, metadata):
    """Returns a number for the load-time check's sample (the reference answer), then fails on what the policy
    writes: the case only the run-time threshold catches."""
    if completion == metadata["answer"]:
        return 1.0
    raise KeyError("tests")


@pytest.mark.e2e
def test_a_run_whose_reward_calls_fail_stops_with_the_first_failure(tmp_path):
    """More than reward.max_error_frac of a step's reward calls failing stops the run (exit 1) with the
    function's error, instead of training to the end on zeros."""
    proc = fleetrl("train", f"run.dir={tmp_path}", "trainer.total_steps=3", "trainer.eval_every=0",
                   "rollout.num_workers=1", "learner.num_ranks=1", "learner.zero_stage=0",
                   "reward.functions=[{name: 'tests.test_faults:broken_in_the_actors'}]")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert "of the reward-function calls failed (reward.max_error_frac=0.5); first: reward function " \
           "'tests.test_faults:broken_in_the_actors' raised KeyError: 'tests'" in proc.stderr, proc.stderr
    metrics = tmp_path / "metrics.jsonl"  # stopped before the first update: no step row, no final policy
    assert not (metrics.exists() and metrics.read_text().strip()) and not (tmp_path / "final").exists()


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_gpus_the_cluster_does_not_have_are_refused_before_anything_starts(tmp_path):
    proc = train(tmp_path / "run", "learner.num_gpus=1", "rollout.num_gpus=1")
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert "the run asks for 4 GPU (learner 2, rollout 2); the cluster has 0" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr  # refused before any actor: the run dir holds the driver's log alone
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["logs"], list((tmp_path / "run").iterdir())


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_a_start_up_past_its_timeout_names_what_it_waits_for(tmp_path):
    proc = train(tmp_path, "run.startup_timeout_s=1", "rollout.num_workers=1", "learner.num_ranks=1",
                 "learner.zero_stage=0")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert "not started after 1 s (run.startup_timeout_s)" in proc.stderr and "the cluster has free" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
