"""On-policy distillation (`algorithm.name: on_policy_distill`) on the real stack: `teacher-i` vLLM engines score the
student's sampled tokens, each token's advantage is the teacher's logprob minus the student's (learner/algorithms.py).
Unit checks of the advantage are in test_algorithms.py, the tokenizer refusal in test_config.py."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import shared_ray_env, subprocess_env
from tests.test_e2e import ROOT
from tests.test_stream import _logprobs, _perturbed_copy

DRIVER = textwrap.dedent("""
    import json, os, sys, threading, time
    from pathlib import Path
    import ray
    from orchestrator.config import load_config
    from orchestrator.loops import train as run_training
    from orchestrator.rl.fleet import Fleet, Roles

    out, student, teacher = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    args = [f"model.path={student}", "algorithm.name=on_policy_distill", "rollout.num_workers=1",
            "learner.num_ranks=1", "learner.zero_stage=0", "learner.lr=1e-3", "trainer.eval_every=0",
            "run.dump_rollouts=true", "data.prompts_per_step=8"]
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)  # the session's head (tests/conftest.py)

    def killer(run_dir):
        try:
            metrics = run_dir / "metrics.jsonl"
            while not metrics.exists() or len(metrics.read_text().splitlines()) < 1:
                time.sleep(0.02)
            ray.kill(fleet.teacher.workers[0], no_restart=True)  # after the first step
            print("KILLED", flush=True)
        except Exception as e:
            print("KILL FAILED", repr(e), flush=True)

    fleet = Fleet(load_config(None, []), Roles())  # every run on one fleet (as tests/fleet_server.py)
    run_training(load_config(None, args + [f"run.dir={out / 'same'}", f"distill.teacher={student}",
                                           "trainer.total_steps=2"]), fleet=fleet)
    for name, steps in (("other", 2), ("again", 3)):  # the second keeps the first's teacher engines
        if name == "again":
            threading.Thread(target=killer, args=(out / name,), daemon=True).start()
        run_training(load_config(None, args + [f"run.dir={out / name}", f"distill.teacher={teacher}",
                                               f"trainer.total_steps={steps}"]), fleet=fleet)
    for name, extra in (("lora", ["learner.lora.rank=4", "rollout.mode=one_step_off"]),
                        ("async", ["rollout.mode=async"])):
        run_training(load_config(None, args + extra + [f"run.dir={out / name}", f"distill.teacher={teacher}",
                                                       "trainer.total_steps=2"]), fleet=fleet)
    fleet.stop()
    print("RESULT done", flush=True)
""")


def _rows(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_on_policy_distillation_scores_every_sampled_token_with_the_teachers_engines(tmp_path, embedded_model):
    """Three runs on one fleet. The teacher is the student: every advantage is exactly 0 (both logprobs come from
    vLLM in fp32, which gives a prompt token the logprob it gave the sampled token) and the policy does not move
    (the saved final weights equal the start's, bit for bit). Then twice another teacher (the student with noise):
    its logprobs of the dumped samples equal transformers' on the same ids (< 1e-4) and the reverse KL is positive;
    the third run keeps the second's teacher engines, and `teacher-0`, killed after its first step, is replaced by
    an engine of the teacher (not of the student: the reverse KL stays positive) and the run finishes. Then a LoRA
    student trained one step off, and the asynchronous mode, each 2 steps with the same teacher."""
    from safetensors.torch import load_file

    teacher = _perturbed_copy(embedded_model, tmp_path / "teacher")
    env = subprocess_env(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", **shared_ray_env())
    r = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), str(embedded_model), str(teacher)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "RESULT done" in r.stdout, (r.stdout + r.stderr)[-6000:]

    same = _rows(tmp_path / "same")
    assert len(same) == 2
    for row in same:
        assert row["distill/reverse_kl"] == 0.0 and row["distill/reverse_kl_max"] == 0.0, row
        assert row["time/teacher_s"] > 0
    start, final = load_file(embedded_model / "model.safetensors"), \
        load_file(tmp_path / "same" / "final" / "model.safetensors")
    assert set(final) <= set(start) and all(final[k].equal(start[k]) for k in final)

    other, again = _rows(tmp_path / "other"), _rows(tmp_path / "again")
    assert [x["step"] for x in other] == [0, 1] and [x["step"] for x in again] == [0, 1, 2]
    assert "KILLED" in r.stdout
    assert all(x["distill/reverse_kl"] > 0 for x in other + again)  # the replacement is the teacher, not the student
    assert again[0]["faults/teacher_restarts"] == 0 and again[-1]["faults/teacher_restarts"] == 1
    worst, n = 0.0, 0
    for f in sorted([*(tmp_path / "other" / "rollouts").iterdir(), *(tmp_path / "again" / "rollouts").iterdir()]):
        for s in map(json.loads, f.read_text().splitlines()):
            expected = _logprobs(teacher, s["prompt_ids"], s["completion_ids"])
            worst = max(worst, float(torch.tensor(expected).sub(torch.tensor(s["teacher_logprobs"])).abs().max()))
            n += len(expected)
    assert n > 0 and worst < 1e-4, worst
    for name in ("lora", "async"):  # a LoRA student one step off, and the asynchronous mode: no special cases
        rows = _rows(tmp_path / name)
        assert [x["step"] for x in rows] == [0, 1] and all(x["distill/reverse_kl"] > 0 for x in rows), rows
    print(f"teacher logprobs vs transformers: max |diff| {worst:.2e} over {n} tokens")
