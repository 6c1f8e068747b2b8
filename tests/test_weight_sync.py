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
    from orchestrator.rl.policy_loop import PolicyLoop

    run_dir, overrides = sys.argv[1], json.loads(sys.argv[2])
    cfg = load_config(None, [f"run.dir={run_dir}", "trainer.total_steps=3", "trainer.eval_every=0",
                             "learner.lr=1e-3", *overrides])
    run = Run(cfg, PolicyLoop)
    init_ray(cfg)
    # a fleet of its own, kept up after the run so its engines can be read
    fleet = Fleet.start(cfg, run.roles, probe=run.probe())
    rows = run.run(fleet)
    learner = load_file(f"{run_dir}/final/model.safetensors")
    tied = "lm_head.weight" not in learner
    if tied:
        learner["lm_head.weight"] = learner["model.embed_tokens.weight"]
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def expected(name):
        for packed, parts in fused.items():
            if packed in name:
                return torch.cat([learner[name.replace(packed, p)] for p in parts])
        return learner[name]

    def diff(name, t):
        e = expected(name)
        if t.shape[0] > e.shape[0] and ("embed_tokens" in name or "lm_head" in name):
            t = t[: e.shape[0]]  # vLLM pads the vocabulary dimension (to a multiple of 64); the pad rows are unused
        return (t.float() - e.float()).abs().max().item()

    out = {"tied": tied, "versions": [r["policy_version"] for r in rows], "engines": []}
    for w in fleet.rollouts.workers:
        engine = ray.get(w.engine_weights.remote())
        diffs = {n: diff(n, t) for n, t in engine.items()}
        stats = ray.get(w.stats.remote())
        version = stats["policy_version"]
        out["engines"].append({"params": len(engine), "max_diff": max(diffs.values()), "version": version,
                               "threads": stats["threads"],
                               "worst": max(diffs, key=diffs.get), "covered": sorted(engine)})
    base = load_file(f"{cfg.model.path}/model.safetensors")
    out["moved"] = max((learner[k] - base[k]).abs().max().item() for k in base)
    out["learner_tensors"] = len(learner)
    # a run without a learner on these engines (Fleet.serve) loads its model from disk into them, in place
    fleet.rollouts.load_model(cfg.model.path)
    learner = dict(base, **({"lm_head.weight": base["model.embed_tokens.weight"]} if tied else {}))
    out["reloaded"] = [max(diff(n, t) for n, t in ray.get(w.engine_weights.remote()).items())
                       for w in fleet.rollouts.workers]
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


# Two runs (~60 s each on 2 cores): each transport once, tied and untied heads once, both in one_step_off, the mode
# where pushes meet an engine that is one step ahead (sync pushes are the simpler case of the same calls, and the
# default path's logprobs are checked by every other end-to-end run).
@pytest.mark.e2e
@pytest.mark.parametrize("sync,tied,mode", [("collective", True, "one_step_off"),
                                            ("object_store", False, "one_step_off")])
def test_every_engine_parameter_equals_the_learners_after_several_pushes(tmp_path, sync, tied, mode):

    overrides = [f"rollout.weight_sync={sync}", f"rollout.mode={mode}", "rollout.num_workers=2",
                 "learner.num_ranks=2", "learner.zero_stage=2"]
    if not tied:
        overrides.append(f"model.path={untied_copy(tmp_path)}")
    env = subprocess_env(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", **shared_ray_env())
    r = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "run"), json.dumps(overrides)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["tied"] == tied and out["versions"] == [0, 1, 2, 3]
    assert out["moved"] > 1e-4  # the policy really changed, so stale engine weights would show
    assert out["reloaded"] == [0.0, 0.0]  # the base model loaded back from disk, every parameter
    for engine in out["engines"]:
        assert engine["version"] == 3
        assert engine["threads"] == 1  # one_step_off: the engines generate while the learner trains
        assert engine["max_diff"] == 0.0, engine["worst"]  # fp32 end to end: bit-identical
        assert "lm_head.weight" in engine["covered"] and any("qkv_proj" in n for n in engine["covered"])
