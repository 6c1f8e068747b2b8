"""A weight push at the learner's dtype vs narrowed to the engines' (issue 63): bytes, seconds and the engines'
logprob gap to the learner, for an fp32 learner pushing into fp32 and bf16 engines.

    python -m bench.push_dtype [--quick]

Models: SmolLM2-135M-Instruct (``make smollm2``), ``push-100m`` and ``push-500m`` (Qwen2.5-0.5B's layer shapes with
the character vocabulary, :mod:`bench.build_models`). For each model and engine dtype, one engine
(``RolloutPool``, eager, the trainer's code) gets pushes of the fp32 weights two ways, alternated ``reps`` times
after an untimed warm-up: **as is** (every tensor in fp32, what a push sent before) and **narrowed** (matrices in
the engine's dtype, :func:`workers.weight_buckets.narrowed_specs`, what the learner sends now). Reported per way:
bytes, the median push seconds (pack + put + in-place reload) and the probe: the engine's greedy completion of a
fixed prompt (24 tokens) and the largest |engine logprob - learner logprob| over its tokens, the learner being the
same weights in fp32 transformers. An fp32 engine gets the same bytes both ways (nothing is narrower).
"""

from __future__ import annotations

import os
import time

import torch

from bench.build_models import model_path
from bench.common import median, parse_args, print_table, require_model, save_result
from bench.weight_push import push

SMOLLM2 = ".fleetrl/models/smollm2-135m-instruct"
FULL = dict(models=[SMOLLM2, str(model_path("push-100m")), str(model_path("push-500m"))], reps=3, tokens=24)
QUICK = dict(models=[str(model_path("push-1m"))], reps=1, tokens=8)
PROMPT = "Question: what is 17 + 25? Answer step by step."


def learner_gap(model, sample) -> float:
    """Largest |engine - learner| logprob over the sample's completion tokens (learner: fp32 transformers)."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    n = len(sample.prompt_ids)
    ours = logp[n - 1:].gather(-1, torch.tensor(sample.completion_ids)[:, None])[:, 0]
    return (ours - torch.tensor(sample.logprobs)).abs().max().item()


def bench_engine(path: str, model, named: list, dtype: str, reps: int, tokens: int) -> dict:
    """One engine of ``dtype`` on ``path``: the two ways of pushing, alternated; then killed."""
    import ray

    from orchestrator.config import load_config
    from orchestrator.rl.pools import RolloutPool

    cfg = load_config(None, [f"model.path={path}", "rollout.num_workers=1", "rollout.max_restarts=0",
                             f"rollout.dtype={dtype}", "rollout.enforce_eager=true"])
    pool = RolloutPool(cfg, max_model_len=128)
    bucket_mb, version = cfg.rollout.weight_bucket_mb, 1
    ways = {"as is": None, "narrowed": dtype}
    push(pool, named, bucket_mb, 1, version)  # warm-up
    runs: dict[str, list] = {way: [] for way in ways}
    gaps: dict[str, float] = {}
    for _ in range(reps):
        for way, narrow in ways.items():
            version += 1
            runs[way].append(push(pool, named, bucket_mb, 1, version, narrow))
            (sample,) = ray.get(pool.workers[0].generate.remote([("p", PROMPT, {})], 1, tokens, 0.0, 1.0, 0))
            gaps[way] = learner_gap(model, sample)
    for w in pool.workers:
        ray.kill(w, no_restart=True)
    return {way: {"bytes": runs[way][0]["bytes"], "push_s": median(r["total_s"] for r in runs[way]),
                  "reload_s": median(r["engine_reload_s"] for r in runs[way]), "probe_gap": gaps[way]}
            for way in ways}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    s = QUICK if args.quick else FULL
    import ray
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False)
    torch.set_num_threads(1)
    results, rows, t0 = {}, [], time.perf_counter()
    for path in s["models"]:
        name = os.path.basename(path)
        require_model(path, name.removeprefix("bench-") if name.startswith("bench-") else None)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        params = sum(t.numel() for _, t in named)
        for dtype in ("float32", "bfloat16"):
            r = results[f"{name} {dtype}"] = bench_engine(path, model, named, dtype, s["reps"], s["tokens"])
            for way, w in r.items():
                rows.append([name, f"{params / 1e6:.0f} M", dtype, way, w["bytes"] / 1e6,
                             w["push_s"], w["reload_s"], w["probe_gap"]])
    ray.shutdown()
    print_table("weight push from an fp32 learner: as is vs narrowed to the engine's dtype (median seconds)",
                ["model", "params", "engine", "push", "MB", "push s", "engine reload s", "probe gap"], rows)
    save_result("push_dtype", args.quick, {"settings": s, "results": results, "seconds": time.perf_counter() - t0})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
