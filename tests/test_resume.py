"""Checkpoint, exact resume in every rollout mode and ZeRO stage, and export, on the real stack."""

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import cli, shared_ray_env, subprocess_env
from tests.test_e2e import ROOT, run_fleetrl

COMMON = ["trainer.total_steps=4", "trainer.save_every=2", "trainer.eval_every=0", "rollout.num_workers=1",
          "learner.lr=1e-4", "learner.log_kl=true"]
# every mode a run can resume in, each at a different ZeRO stage: the state that must survive is different in each
# (the critic's weights and optimizer for PPO, the batch in flight for one_step_off, the sampling rounds' prompt
# stream for dynamic sampling)
MODES = {
    "grpo-sync-zero2-2ranks": ["learner.num_ranks=2", "learner.zero_stage=2"],
    "ppo-one_step_off-zero3-2ranks": ["algorithm.name=ppo", "rollout.mode=one_step_off", "learner.num_ranks=2",
                                      "learner.zero_stage=3"],
    "rloo-dynamic_sampling-zero0": ["algorithm.name=rloo", "rollout.dynamic_sampling=true", "learner.num_ranks=1",
                                    "learner.zero_stage=0"],
    # LoRA: the checkpoint holds the adapters and their AdamW state only, the KL reference is the base with them
    # off, each push broadcasts the adapter alone and the engine serves it as a new LoRARequest; the exports:
    # merged (not the base) and the adapter alone (the merged push: tests/test_lora.py). PPO's critic trains its
    # own adapters and value head (learner.lora.critic), which its checkpoint holds and the resume restores
    "ppo-lora_critic-adapter_push-collective-zero2-2ranks": [
        "algorithm.name=ppo", "learner.num_ranks=2", "learner.zero_stage=2", "learner.lora.rank=8",
        "learner.lora.push=adapter", "learner.lora.target_modules=[q_proj,v_proj]", "learner.lora.critic=true",
        "rollout.weight_sync=collective", "learner.lr=3e-3", "algorithm.critic_lr=3e-3"],
}
SAME = ("reward/mean", "loss", "kl", "entropy", "actor/grad_norm", "rollout/logprob_gap_max", "rollout/staleness_max")


def _with_learner_mark(mode: str):
    """``mode`` marked with its learner group (tests/conftest.py orders the end-to-end tests by it)."""
    given = dict(a.split("=", 1) for a in MODES[mode] if a.startswith("learner.num_ranks=")
                 or a.startswith("learner.zero_stage="))
    return pytest.param(mode, marks=pytest.mark.learner(ranks=int(given["learner.num_ranks"]),
                                                        zero_stage=int(given["learner.zero_stage"])))


@pytest.mark.e2e
@pytest.mark.parametrize("mode", [_with_learner_mark(m) for m in MODES])
def test_resume_is_exact(tmp_path, mode):
    """4 steps straight, and 2 steps resumed from the step-2 checkpoint: the same rewards, losses, KL, gradient
    norms (and value losses, sampling rounds) at steps 2 and 3."""
    full = run_fleetrl(tmp_path / "full", *COMMON, *MODES[mode])
    ckpts = sorted((tmp_path / "full" / "checkpoints").glob("step_*"))
    assert [p.name for p in ckpts] == ["step_000002", "step_000004"]
    assert all((p / "COMPLETE").exists() and (p / "policy" / "model.safetensors").exists() for p in ckpts)
    assert json.loads((ckpts[0] / "trainer_state.json").read_text()) == {"step": 2, "policy_version": 2}
    assert (ckpts[0] / "in_flight.json").exists() == ("one_step_off" in mode)

    resumed = run_fleetrl(tmp_path / "resumed", *COMMON, *MODES[mode], "--resume", str(ckpts[0]))
    by_step = {r["step"]: r for r in resumed}
    assert sorted(by_step) == [2, 3, 4]
    keys = SAME + (("critic/value_loss", "critic/grad_norm") if "ppo" in mode else ()) + (
        ("sampling/rounds", "sampling/informative_groups") if "dynamic" in mode else ())
    for row in full[2:4]:
        other = by_step[row["step"]]
        assert other["policy_version"] == row["policy_version"]
        for key in keys:
            assert other[key] == pytest.approx(row[key], rel=1e-5, abs=1e-7), (row["step"], key)
        assert other["weight_sync/logprob_max_diff"] < 1e-3  # the restored weights reached the engine
    if mode.startswith("grpo") or "lora" in mode:
        out = tmp_path / "exported"
        r = subprocess.run([sys.executable, "-m", "orchestrator", "export", str(tmp_path / "full"), "--out",
                            str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    if mode.startswith("grpo"):  # the LoRA export's merged model is checked against PEFT and vLLM's adapter below
        _vllm_matches_transformers(out)
    if "lora" in mode:
        assert all(r["weight_sync/logprob_max_diff"] < 1e-3 for r in full if "weight_sync/logprob_max_diff" in r)
        _lora_exports(tmp_path / "full", tmp_path / "exported", tmp_path / "adapter")


def _lora_exports(run_dir, merged, adapter_dir):
    """The merged export differs from the base (so the training reached it); the adapter export is PEFT's format
    and the base plus it gives the merged model's logprobs (<= 1e-4, fp32), in PEFT and as a vLLM LoRARequest."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    r = subprocess.run([sys.executable, "-m", "orchestrator", "export", str(run_dir), "--adapter", "--out",
                        str(adapter_dir)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (adapter_dir / "adapter_config.json").exists() and not (merged / "adapter").exists()
    base_path = ROOT / ".fleetrl" / "models" / "arith-base"
    ids = torch.tensor([[2, 5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        out = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits.log_softmax(-1)
        base = AutoModelForCausalLM.from_pretrained(base_path).eval()
        base_out = base(input_ids=ids).logits.log_softmax(-1)
        adapted = PeftModel.from_pretrained(base, str(adapter_dir)).eval()(input_ids=ids).logits.log_softmax(-1)
    assert (out - base_out).abs().max() > 1e-3
    assert (adapted - out).abs().max() <= 1e-4
    _vllm_matches_transformers(merged, base=base_path, adapter=adapter_dir)  # the adapter served by vLLM


def _vllm_matches_transformers(model_dir, base=None, adapter=None):
    """vLLM's logprobs of its own samples equal transformers' on ``model_dir`` (< 1e-4, fp32). With ``adapter`` the
    engine serves ``base`` plus that PEFT adapter as a LoRARequest (vLLM's CPU LoRA kernels)."""
    engine = base or model_dir
    lora = dict(enable_lora=True, max_lora_rank=64, max_loras=1) if adapter else {}
    request = f"LoRARequest('policy', 1, {str(adapter)!r})" if adapter else "None"
    script = textwrap.dedent(f"""
        import os
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        if __name__ == "__main__":
            path = {str(model_dir)!r}
            llm = LLM(model={str(engine)!r}, dtype="float32", enforce_eager=True, max_model_len=32,
                      kv_cache_memory_bytes=2**27, **{lora!r})
            tok = AutoTokenizer.from_pretrained(path)
            hf = AutoModelForCausalLM.from_pretrained(path).eval()
            worst = 0.0
            for prompt in ["12+30=", "7+58=", "99+1="]:
                ids = tok(prompt)["input_ids"]
                out = llm.generate([{{"prompt_token_ids": ids}}],
                                   SamplingParams(max_tokens=4, logprobs=0, temperature=1.0, seed=0),
                                   lora_request={request})
                c = out[0].outputs[0]
                toks = list(c.token_ids)
                with torch.no_grad():
                    lp = hf(torch.tensor([ids + toks])).logits.log_softmax(-1)[0, len(ids) - 1:-1]
                for i, t in enumerate(toks):
                    worst = max(worst, abs(lp[i, t].item() - c.logprobs[i][t].logprob))
            print("MAXDIFF", worst)
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("MAXDIFF")]
    assert lines, r.stdout[-3000:] + r.stderr[-3000:]
    assert float(lines[0].split()[1]) < 1e-4


def test_bad_resume_path_exits_2_before_starting_ray(tmp_path):
    r = cli("train", f"run.dir={tmp_path}", "--resume", "auto")
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr
    assert "Started a local Ray instance" not in r.stderr


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_full_disk_during_checkpoint_keeps_previous_one(tmp_path):
    """A run dir on a small tmpfs: the first checkpoint fits, the second does not. The error says the disk
    filled and names the previous checkpoint, which stays complete and resolvable."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run_dir = mnt / "run"
        cmd = [sys.executable, "-m", "orchestrator", "train", f"run.dir={run_dir}", "trainer.total_steps=4",
               "trainer.eval_every=0", "trainer.save_every=1", "trainer.keep_checkpoints=1", "rollout.num_workers=1",
               "learner.num_ranks=1", "learner.zero_stage=0"]
        env = subprocess_env(RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", **shared_ray_env())
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 1
        assert "checkpoint at step 2 failed" in r.stderr and "MB free" in r.stderr, r.stderr[-3000:]
        assert "step_000001 is intact" in r.stderr
        assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # the partial write was cleaned up
        from orchestrator.rl import checkpoint as ckpt

        good = ckpt.resolve("auto", run_dir)
        assert good.name == "step_000001" and (good / "policy" / "model.safetensors").exists()
        assert ckpt.load_state(good) == {"step": 1, "policy_version": 1}
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_sigterm_checkpoints_exits_143_and_resumes(tmp_path):
    """SIGTERM (a preempted node) during a run with no checkpoint cadence: the step ends, a checkpoint of it is
    written, one line says so, the run's status is `preempted` and the process exits 143; `--resume auto`
    continues from that step (and ends with the final policy)."""
    import signal
    import time

    from tests.test_e2e import train

    run_dir = tmp_path / "run"
    small = ["trainer.eval_every=0", "trainer.save_every_s=0", "rollout.num_workers=1", "learner.num_ranks=1",
             "learner.zero_stage=0"]
    env = subprocess_env(RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", **shared_ray_env())
    cmd = [sys.executable, "-m", "orchestrator", "train", f"run.dir={run_dir}", "trainer.total_steps=200", *small]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.time() + 400
        while not (metrics.exists() and "reward/mean" in metrics.read_text()) and proc.poll() is None:
            assert time.time() < deadline, "no step within 400 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 143, out[-4000:]
    (found,) = ckpt_dirs = sorted((run_dir / "checkpoints").glob("step_*"))
    step = json.loads((found / "trainer_state.json").read_text())["step"]
    assert (found / "COMPLETE").exists() and 1 <= step < 200, ckpt_dirs
    assert f"fleetrl: SIGTERM: stopped after step {step - 1}; resume with `--resume auto` from {found}" in out, out
    assert json.loads((run_dir / "status.json").read_text())["state"] == "preempted"
    assert not (run_dir / "final").exists()

    r = train(run_dir, f"trainer.total_steps={step + 1}", *small, "--resume", "auto")
    assert r.returncode == 0 and f"resumed from {found} at step {step}" in r.stdout, (r.stdout + r.stderr)[-4000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == list(range(step + 2))  # each step once; the last row is the final one
    assert (run_dir / "final" / "config.json").exists()
