"""Completions scored per second by one reward worker, for the ``math`` and ``code`` rewards.

``math``: arithmetic prompts of the embedded task, completions that are the bare answer ("42").
``code``: a correct stdin/stdout program per completion, 3 test cases each, every completion in its own
sandbox (rewards/sandbox.py). Measured on a plain :class:`rewards.worker.RewardWorker` and, with ``--ray``,
on the same class as one Ray actor (as the trainer runs it). Prints a table and writes
``bench/results/reward_throughput.json``.

    .venv/bin/python bench/reward_throughput.py [--ray] [--math-n 2000] [--code-n 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rewards.tasks import ArithmeticTask  # noqa: E402
from rewards.worker import RewardWorker  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "reward_throughput.json"
PROGRAM = "```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n```"


def math_items(n: int) -> list[tuple[str, str, dict]]:
    prompts = ArithmeticTask(seed=0).train_batch(0, n)
    return [(p.text, p.metadata["answer"], p.metadata) for p in prompts]


def code_items(n: int) -> list[tuple[str, str, dict]]:
    items = []
    for i in range(n):
        tests = [{"input": f"{i} {j}\n", "output": f"{i + j}\n"} for j in range(3)]
        items.append(("Read two integers and print their sum.", PROGRAM, {"tests": tests}))
    return items


def measure(score, items: list, name: str, backend: str) -> dict:
    """One warm-up call on a few items, then one timed call on all of them; every score must be 1."""
    score(items[:4])
    start = time.perf_counter()
    rewards = score(items)
    seconds = time.perf_counter() - start
    if any(r != 1.0 for r in rewards):
        raise RuntimeError(f"{backend}/{name}: expected every completion to score 1, got {sorted(set(rewards))}")
    return {"backend": backend, "reward": name, "completions": len(items), "seconds": round(seconds, 3),
            "per_second": round(len(items) / seconds, 1)}


def plain_scorer(spec: tuple[str, float, dict], threads: int):
    worker = RewardWorker([spec], timeout_s=60, strict=True, max_threads=threads)
    return lambda items: [r.reward for r in worker.score(items)[0]]


def ray_scorer(spec: tuple[str, float, dict], threads: int):
    import ray

    actor = ray.remote(RewardWorker).options(num_cpus=0.25).remote([spec], 60, True, threads)
    return lambda items: [r.reward for r in ray.get(actor.score.remote(items))[0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--math-n", type=int, default=2000)
    ap.add_argument("--code-n", type=int, default=64)
    ap.add_argument("--threads", type=int, default=8, help="RewardWorker max_threads")
    ap.add_argument("--ray", action="store_true", help="also measure one Ray actor")
    args = ap.parse_args()
    workloads = [(("math", 1.0, {}), math_items(args.math_n)), (("code", 1.0, {}), code_items(args.code_n))]
    backends = [("plain", plain_scorer)]
    if args.ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
        backends.append(("ray actor", ray_scorer))
    rows = [measure(make(spec, args.threads), items, spec[0], backend)
            for backend, make in backends for spec, items in workloads]
    print(f"{'backend':10} {'reward':6} {'completions':>11} {'seconds':>8} {'per second':>11}")
    for r in rows:
        print(f"{r['backend']:10} {r['reward']:6} {r['completions']:>11} {r['seconds']:>8.2f} {r['per_second']:>11.1f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "threads": args.threads, "load_avg_1m": os.getloadavg()[0]},
                               "results": rows}, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
