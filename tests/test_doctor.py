"""The mismatch doctor (orchestrator/rl/doctor.py): the gap statistics, the verdict's cause order, and on the shared
fleet its verdicts on injected faults (a learner temperature unlike the sampling one; a corrupted push)."""

import pytest
import torch

from learner.corrections import logprob_gap_stats
from orchestrator.rl.doctor import Diagnosis, Finding


def test_gap_stats_are_over_the_masked_tokens_only():
    """max, p99 (linear interpolation) and mean of |learner - engine| over the response mask; padding never counts."""
    engine = torch.zeros(2, 101)
    learner = torch.zeros(2, 101)
    learner[0] = torch.arange(101, dtype=torch.float32) / 100  # gaps 0, 0.01, ..., 1.0
    learner[1] = 50.0  # a padded row
    mask = torch.zeros(2, 101)
    mask[0] = 1.0
    stats = logprob_gap_stats(learner, engine, mask)
    assert stats == pytest.approx({"max": 1.0, "p99": 0.99, "mean": 0.5})
    assert logprob_gap_stats(learner, engine, torch.zeros(2, 101)) == {"max": 0.0, "p99": 0.0, "mean": 0.0}


def _diagnosis(p99: float, failed: set[str]) -> Diagnosis:
    tests = ["push", "temperature", "top_p", "tokenization", "dtype"]
    return Diagnosis({"max": 2 * p99, "p99": p99, "mean": p99 / 4}, 100, 8, 0.5,
                     [Finding(t, t not in failed, f"{t} detail", f"{t} fix") for t in tests])


def test_the_verdict_gates_on_the_p99_and_names_the_first_failed_test_dtype_and_tokenization_last():
    assert _diagnosis(0.4, {"dtype"}).healthy and _diagnosis(0.4, {"dtype"}).lines()[-1].startswith("verdict: healthy")
    refused = _diagnosis(0.6, {"dtype", "tokenization", "temperature"})
    assert not refused.healthy and refused.cause.test == "temperature"
    assert "cause: temperature: temperature detail. fix: temperature fix" in refused.lines()[-1]
    assert _diagnosis(0.6, {"tokenization", "dtype"}).cause.test == "dtype"
    assert "unknown" in _diagnosis(0.6, set()).lines()[-1]


SMALL = ("rollout.num_workers=1", "learner.num_ranks=1", "learner.zero_stage=0", "trainer.eval_every=0")


@pytest.mark.e2e
def test_the_doctor_names_a_learner_temperature_unlike_the_sampling_one(tmp_path):
    """Only this test guards the temperature test and `fleetrl doctor`'s exit status: a learner that scores at
    T = 0.5 the tokens the engines sampled at T = 1 (an injected fault: the learner's real spec) is refused with
    the temperature named, and rescoring at the sampling temperature closes the gap."""
    from orchestrator.rl.specs import FAULT_LEARNER_TEMPERATURE
    from tests.conftest import FLEET_SERVER

    proc = FLEET_SERVER.run(["doctor", f"run.dir={tmp_path / 'run'}", *SMALL], 600, {FAULT_LEARNER_TEMPERATURE: "0.5"})
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("verdict: REFUSED") and "cause: temperature: learner scores at T=0.5" in verdict, verdict
    assert "  push         ok" in proc.stdout and "  temperature  FAIL" in proc.stdout, proc.stdout


@pytest.mark.e2e
def test_a_corrupted_push_refuses_the_run_before_step_0(tmp_path):
    """Only this test guards the push checksums and the driver's refusal: a push whose final norm the driver
    doubled (an injected fault in the real object-store push) stops `fleetrl train` before step 0 (exit 1), the
    message naming the corrupted tensor; healthy, the embedded model's fp32 gap is ~1e-5."""
    from orchestrator.rl.weight_sync import FAULT_CORRUPT_PUSH
    from tests.conftest import FLEET_SERVER

    run_dir = tmp_path / "run"
    # the embedded model's doubled norm moves the p99 by ~0.4 nats, under the default limit: the changed push
    # alone refuses the run
    proc = FLEET_SERVER.run(["train", f"run.dir={run_dir}", "trainer.total_steps=2", *SMALL], 600,
                            {FAULT_CORRUPT_PUSH: "model.norm.weight"})
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    assert "cause: push: 1 tensor(s) differ, e.g. model.norm.weight on rollout-0" in proc.stderr, proc.stderr[-4000:]
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
