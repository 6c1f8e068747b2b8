"""Weight push: seconds and GB/s to push 1 M, 10 M and 100 M-param models into 1 and 2 running rollout engines,
next to a plain in-memory copy of the same bytes (the floor).

    python -m bench.weight_push [--quick]

The real path of a training step's push: the named parameters are packed into byte buckets of at most
``rollout.weight_bucket_mb`` (``workers.weight_buckets``, the learner's code), put into Ray's object store, and
every engine reloads in place from them (``RolloutWorker.load_weights``, a vLLM layer-wise reload, through the
``RolloutPool`` the trainer uses). Here the driver packs (in training the learner's rank 0 does, same code).
Total = pack + put + load; GB/s = model bytes / total. One untimed warm-up push per size, then the median of
``reps``. Afterwards a push with a zeroed output layer checks that the engines really serve the pushed weights
(every sampled token then has logprob -log(vocab)).
"""

from __future__ import annotations

import math
import os
import time

import torch

from bench.build_models import model_path, params_of
from bench.common import median, parse_args, print_table, require_model, save_result

FULL = dict(models=["push-1m", "push-10m", "push-100m"], reps=3)
QUICK = dict(models=["push-1m"], reps=1)


def push(pool, named, bucket_mb: float, workers: int, version: int, narrow: str | None = None) -> dict:
    """One push into the first ``workers`` engines of ``pool`` (``narrow``: matrices sent in that dtype, as the
    learner does for narrower engines); phase seconds and bytes."""
    import ray

    from workers.weight_buckets import gathered_buckets, narrowed_specs, param_specs, plan_buckets, to_object

    t0 = time.perf_counter()
    plans = plan_buckets(narrowed_specs(param_specs(named), narrow), int(bucket_mb * 2**20))
    buckets = [to_object(plan, chunk) for plan, chunk in gathered_buckets(plans, dict(named))]
    t1 = time.perf_counter()
    refs = [ray.put(b) for b in buckets]
    t2 = time.perf_counter()
    if workers == len(pool.workers):
        loads = pool.load_weights(refs, version)
    else:
        loads = ray.get([w.load_weights.remote(refs, version) for w in pool.workers[:workers]])
    t3 = time.perf_counter()
    return {"pack_s": t1 - t0, "put_s": t2 - t1, "load_s": t3 - t2, "total_s": t3 - t0, "buckets": len(refs),
            "engine_reload_s": max(x["seconds"] for x in loads), "bytes": sum(p.nbytes for p in plans)}


def memcpy_floor(nbytes: int, reps: int = 5) -> float:
    """Median seconds of one plain copy of ``nbytes`` bytes between two preallocated CPU buffers."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - t0)
    return median(seconds)


def check_served(pool, named, bucket_mb: float, version: int) -> float:
    """Push the weights with a zeroed output layer and return max |logprob + log V| of sampled tokens on every
    engine (0 when the engines serve the pushed weights)."""
    import ray

    zeroed = [(n, torch.zeros_like(t) if n == "lm_head.weight" else t) for n, t in named]
    vocab = dict(named)["lm_head.weight"].shape[0]
    push(pool, zeroed, bucket_mb, len(pool.workers), version)
    outs = ray.get([w.generate.remote([("chk", "1+2=", {})], 2, 4, 1.0, 1.0, 0) for w in pool.workers])
    return max(abs(lp + math.log(vocab)) for out in outs for s in out for lp in s.logprobs)


def bench_model(name: str, reps: int) -> dict:
    """Start 2 engines on preset ``name``, time pushes to 1 and 2 of them, then shut them down."""
    import ray
    from transformers import AutoModelForCausalLM

    from orchestrator.config import load_config
    from orchestrator.rl.pools import RolloutPool

    path = str(model_path(name))
    require_model(path, name)
    cfg = load_config(None, [f"model.path={path}", "rollout.num_workers=2", "rollout.max_restarts=0"])
    pool = RolloutPool(cfg, max_model_len=64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    bucket_mb = cfg.rollout.weight_bucket_mb
    version, out = 1, {"params": params_of(name), "bytes": nbytes, "bucket_mb": bucket_mb}
    push(pool, named, bucket_mb, 2, version)  # warm-up
    for workers in (1, 2):
        runs = []
        for _ in range(reps):
            version += 1
            runs.append(push(pool, named, bucket_mb, workers, version))
        out[f"workers_{workers}"] = {k: median(r[k] for r in runs) for k in runs[0]}
    out["memcpy_s"] = memcpy_floor(nbytes)
    out["served_logprob_err"] = check_served(pool, named, bucket_mb, version + 1)
    for w in pool.workers:
        ray.kill(w, no_restart=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    s = QUICK if args.quick else FULL
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False)
    torch.set_num_threads(1)
    results, rows = {}, []
    for name in s["models"]:
        r = results[name] = bench_model(name, s["reps"])
        gb = r["bytes"] / 1e9
        if r["served_logprob_err"] > 1e-4:
            raise RuntimeError(f"{name}: engines do not serve the pushed weights (logprob error "
                               f"{r['served_logprob_err']:.2e})")
        for workers in (1, 2):
            w = r[f"workers_{workers}"]
            rows.append([f"{r['params'] / 1e6:.1f} M ({gb * 1e3:.0f} MB)", workers, w["total_s"], gb / w["total_s"],
                         w["pack_s"], w["put_s"], w["load_s"], w["engine_reload_s"], r["memcpy_s"],
                         gb / r["memcpy_s"]])
    ray.shutdown()
    print_table("weight push: pack -> Ray object store -> in-place vLLM reload (median)",
                ["model", "engines", "push s", "push GB/s", "pack s", "put s", "load s", "engine reload s",
                 "memcpy s (floor)", "memcpy GB/s"], rows)
    save_result("weight_push", args.quick, {"settings": s, "models": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
