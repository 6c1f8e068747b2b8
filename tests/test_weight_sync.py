"""After several training steps every engine holds exactly the learner's weights: each vLLM parameter (fused
qkv / gate-up projections, the LM head, tied or not) is compared tensor by tensor with the learner's final policy,
for both push paths (Ray object store, collective broadcast) and in ``one_step_off`` mode. Real Ray, vLLM and
DeepSpeed; the trainer runs in-process so its actors can be asked for their weights afterwards."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import shared_ray_env, subprocess_env
from tests.test_e2e import ROOT

DRIVER = textwrap.dedent("""
    import json, sys
    import ray, torch
    from safetensors.torch import load_file
    from orchestrator.config import load_config
    from orchestrator.rl.fleet import Fleet
    from orchestrator.rl.launch import init_ray
    from orchestrator.rl.driver import Run
    from orchestrator.loops.policy import PolicyLoop

    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def expected(learner, name, t):
        e = next((torch.cat([learner[name.replace(packed, p)] for p in parts]) for packed, parts in fused.items()
                  if packed in name), None)
        e = learner[name] if e is None else e
        if t.shape[0] > e.shape[0] and ("embed_tokens" in name or "lm_head" in name):
            t = t[: e.shape[0]]  # vLLM pads the vocabulary dimension (to a multiple of 64); the pad rows are unused
        return t, e

    def diff(learner, name, t):
        t, e = expected(learner, name, t)
        return (t.float() - e.to(t.dtype).float()).abs().max().item()  # a bf16 engine: the learner's, rounded

    def off_by_more_than_a_bf16_step(learner, name, t):
        t, e = expected(learner, name, t)
        return int(((t.float() - e.float()).abs() > e.float().abs() * 2**-7).sum())

    def with_head(weights):
        tied = "lm_head.weight" not in weights
        return tied, dict(weights, **({"lm_head.weight": weights["model.embed_tokens.weight"]} if tied else {}))

    fleet, out = None, []
    for run_dir, overrides in json.loads(sys.argv[1]):  # runs one after another on one fleet (Fleet.serve)
        cfg = load_config(None, [f"run.dir={run_dir}", "trainer.total_steps=3", "trainer.eval_every=0",
                                 "learner.lr=1e-3", *overrides])
        run = Run(cfg, PolicyLoop)
        if fleet is None:  # a fleet of its own, kept up after the runs so its engines can be read
            init_ray(cfg)
            fleet = Fleet.start(cfg, run.roles, probe=run.probe())
        rows = run.run(fleet)
        saved = load_file(f"{run_dir}/final/model.safetensors")
        tied, learner = with_head(saved)
        res = {"tied": tied, "versions": [r["policy_version"] for r in rows], "engines": [], "kept": fleet.kept,
               "bytes": rows[1]["weight_sync/bytes"], "fp32_bytes": sum(t.numel() * 4 for t in saved.values())}
        for w in fleet.rollouts.workers:
            engine = ray.get(w.engine_weights.remote())
            diffs = {n: diff(learner, n, t) for n, t in engine.items()}
            stats = ray.get(w.stats.remote())
            matrices = [d for n, d in diffs.items() if engine[n].dim() >= 2]
            off = sum(off_by_more_than_a_bf16_step(learner, n, t) for n, t in engine.items())
            res["engines"].append({"params": len(engine), "max_diff": max(diffs.values()), "pid": stats["pid"],
                                   "matrices_max_diff": max(matrices), "off_by_more_than_a_bf16_step": off,
                                   "dtype": str(next(iter(engine.values())).dtype),
                                   "version": stats["policy_version"], "threads": stats["threads"],
                                   "worst": max(diffs, key=diffs.get), "covered": sorted(engine)})
        base = load_file(f"{cfg.model.path}/model.safetensors")
        res["moved"] = max((learner[k] - base[k]).abs().max().item() for k in base)
        out.append(res)
    # a run without a learner on these engines (Fleet.serve) loads its model from disk into them, in place
    fleet.rollouts.load_model(cfg.model.path)
    base = with_head(base)[1]
    out[-1]["reloaded"] = [sum(off_by_more_than_a_bf16_step(base, n, t) for n, t in
                               ray.get(w.engine_weights.remote()).items()) for w in fleet.rollouts.workers]
    print("RESULT " + json.dumps(out), flush=True)
""")


def untied_copy(tmp: Path, src: Path | str | None = None) -> Path:
    """``src`` (default: the embedded model) with its own output head (tie_word_embeddings=False, the head a
    perturbed copy)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from orchestrator.config import EMBEDDED_MODEL_PATH

    src = Path(src) if src is not None else ROOT / EMBEDDED_MODEL_PATH
    config = AutoConfig.from_pretrained(src)
    config.tie_word_embeddings = False
    tied = AutoModelForCausalLM.from_pretrained(src)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tied.state_dict(), strict=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(tied.model.embed_tokens.weight + 0.01 * torch.randn_like(model.lm_head.weight))
    out = tmp / "untied"
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


# Two runs on one fleet (~90 s on 2 cores): each transport once, tied and untied heads once, both in one_step_off,
# the mode where pushes meet an engine that is one step ahead (sync pushes are the simpler case of the same calls,
# and the default path's logprobs are checked by every other end-to-end run). The second run's model has another
# head layout and its engines other threads, so the fleet keeps the rollout actors and rebuilds their engines in
# place (Fleet.serve): only this test checks rebuilt engines parameter by parameter.
@pytest.mark.own_fleet
@pytest.mark.e2e
def test_every_engine_parameter_equals_the_learners_after_several_pushes(tmp_path):
    common = ["rollout.mode=one_step_off", "rollout.num_workers=2", "learner.num_ranks=2", "learner.zero_stage=2"]
    runs = [(str(tmp_path / "collective"), ["rollout.weight_sync=collective", *common]),
            (str(tmp_path / "object_store"), ["rollout.weight_sync=object_store", *common, "rollout.cpu_threads=2",
                                              f"model.path={untied_copy(tmp_path)}", "rollout.dtype=bfloat16",
                                              "rollout.enforce_eager=true"])]
    env = subprocess_env(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", **shared_ray_env())
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(runs)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-4000:]
    first, second = json.loads(lines[0][len("RESULT "):])
    assert first["tied"] and not second["tied"]
    assert "rollout" in second["kept"] and [e["pid"] for e in first["engines"]] == [e["pid"] for e in second["engines"]]
    # the untied model loaded back from disk, every parameter: fp32 tensors that vLLM's reload rounds to bf16 (not
    # always to nearest, so within one bf16 step; a stale parameter would be off by the training's steps)
    assert second["reloaded"] == [0, 0]
    # the second run's engines serve bf16 from an fp32 learner: a push sends its matrices in bf16 (about half the
    # bytes), rounded to nearest on the learner, so every engine parameter is the learner's rounded, exactly
    for out, threads, dtype in ((first, 1, "torch.float32"), (second, 2, "torch.bfloat16")):  # one_step_off: 1
        assert out["versions"] == [0, 1, 2, 3] and all(e["dtype"] == dtype for e in out["engines"])
        assert out["moved"] > 1e-4  # the policy really changed, so stale engine weights would show
        for engine in out["engines"]:
            assert engine["version"] == 3 and engine["threads"] == threads
            if dtype == "torch.float32":
                assert engine["max_diff"] == 0.0, engine["worst"]  # fp32 end to end: bit-identical
            else:  # bf16 matrices as sent; vLLM's reload rounds a bf16 engine's vectors within one bf16 step
                assert engine["matrices_max_diff"] == 0.0 and engine["off_by_more_than_a_bf16_step"] == 0, engine
            assert "lm_head.weight" in engine["covered"] and any("qkv_proj" in n for n in engine["covered"])
    assert first["bytes"] == first["fp32_bytes"] and 0.5 < second["bytes"] / second["fp32_bytes"] < 0.51


def test_a_push_to_narrower_engines_sends_their_dtype_rounded_as_their_load_would():
    import torch

    from workers.weight_buckets import narrowed_specs, pack_bucket, plan_buckets, unpack_bucket

    specs = [("w", (64, 64), "float32"), ("b", (5,), "float32"), ("ids", (4,), "int64")]
    assert narrowed_specs(specs, None) == specs and narrowed_specs(specs, "float32") == specs  # never wider
    narrow = narrowed_specs(specs, "bfloat16")  # matrices only: a CPU engine may keep vectors in fp32
    assert narrow == [("w", (64, 64), "bfloat16"), ("b", (5,), "float32"), ("ids", (4,), "int64")]
    tensors = [torch.randn(64, 64), torch.randn(5), torch.arange(4)]
    (plan,) = plan_buckets(narrow, 2**20)
    (wide,) = plan_buckets(specs, 2**20)
    assert plan.nbytes < wide.nbytes
    got = dict(unpack_bucket(plan, pack_bucket(plan, tensors)))
    # rounded to nearest, as param.copy_(fp32) into a bf16 parameter rounds
    engine = torch.empty(64, 64, dtype=torch.bfloat16).copy_(tensors[0])
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"].view(torch.int16), engine.view(torch.int16))
    assert torch.equal(got["b"], tensors[1]) and torch.equal(got["ids"], tensors[2])
    with pytest.raises(ValueError, match="planned int64"):
        pack_bucket(plan, [tensors[0], tensors[1], torch.arange(4.0)])  # only floating tensors are rounded
