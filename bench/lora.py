"""LoRA against full fine-tuning on SmolLM2-135M-Instruct (the demo task, ``configs/smollm2_arith_lora.yaml``):
learner seconds per step, the learner ranks' peak RSS, push bytes and seconds, for full weights and LoRA ranks 8,
32 and 128 on every linear layer (alpha = 2 x rank) with the merged push, and ranks 8 and 32 with the adapter push
(the engines serve base + adapter through vLLM's LoRA kernels: generation seconds per step in the table too), each
a real ``fleetrl train`` run (vLLM engines, DeepSpeed ranks, Ray) of a few steps with evals off.

    python -m bench.lora [--quick] [--steps N]

The first step of each run is a warm-up and is dropped; the numbers are medians over the rest. Writes
``bench/results/lora.json``; docs/BENCHMARKS.md's table is generated from it (``python -m bench.tables``).
Not measured here: held-out accuracy against wall-clock time for full vs LoRA (two ~45-minute runs).
"""

from __future__ import annotations

from bench.common import median, parse_args, print_table, require_model, run_fleetrl, save_result, training_rows

CONFIG = "configs/smollm2_arith_lora.yaml"
MODEL = ".fleetrl/models/smollm2-135m-instruct"
# label: overrides (the config's rank-32 adapters, lr 2e-4; full fine-tuning at the demo's 2e-5)
VARIANTS = {
    "full fine-tuning": ["learner.lora.rank=0", "learner.lr=2e-5"],
    "LoRA r=8": ["learner.lora.rank=8", "learner.lora.alpha=16"],
    "LoRA r=32": ["learner.lora.rank=32", "learner.lora.alpha=64"],
    "LoRA r=128": ["learner.lora.rank=128", "learner.lora.alpha=256"],
    "LoRA r=8, push adapter": ["learner.lora.rank=8", "learner.lora.alpha=16", "learner.lora.push=adapter"],
    "LoRA r=32, push adapter": ["learner.lora.rank=32", "learner.lora.alpha=64", "learner.lora.push=adapter"],
}


def measure(label: str, steps: int) -> dict:
    name = "lora_" + label.replace(" ", "_").replace("=", "").replace("-", "_")
    run = run_fleetrl(name, CONFIG, [*VARIANTS[label], f"trainer.total_steps={steps}", "trainer.eval_every=0",
                                     "trainer.time_budget_s=null"], timeout_s=3600)
    rows = training_rows(run["rows"], skip=1)
    return {
        "learner_s": round(median(r["time/learn_s"] for r in rows), 2),
        "step_s": round(median(r["time/step_s"] for r in rows), 2),
        "generate_s": round(median(r["time/generate_s"] for r in rows), 2),
        "peak_rss_mb": round(max(r["memory/actor_peak_rss_mb_max"] for r in run["rows"]
                                 if "memory/actor_peak_rss_mb_max" in r)),
        "push_mb": round(rows[-1]["weight_sync/bytes"] / 2**20, 2),
        "push_s": round(median(r["time/sync_s"] for r in rows), 3),
        "probe_max": max(r["weight_sync/logprob_max_diff"] for r in run["rows"]
                         if "weight_sync/logprob_max_diff" in r),
        "steps": len(rows), "wall_s": round(run["wall_s"], 1), "command": run["command"],
    }


def table(results: dict) -> tuple[list[str], list[list]]:
    full = results["full fine-tuning"]
    headers = ["variant", "learner s/step", "x full (speed)", "peak RSS MB per rank", "push MB", "% of full push",
               "push s (incl. probe)", "probe max \\|dlogp\\|", "generate s/step", "step s"]
    rows = [[label, r["learner_s"], round(full["learner_s"] / r["learner_s"], 2), r["peak_rss_mb"], r["push_mb"],
             round(100 * r["push_mb"] / full["push_mb"], 1), r["push_s"], f"{r['probe_max']:.1e}", r["generate_s"],
             r["step_s"]]
            for label, r in results.items()]
    return headers, rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, lambda ap: ap.add_argument("--steps", type=int, default=3))
    require_model(MODEL)
    steps = 2 if args.quick else args.steps
    results = {label: measure(label, steps) for label in VARIANTS}
    print_table("LoRA vs full fine-tuning, SmolLM2-135M-Instruct", *table(results))
    save_result("lora", args.quick, {"config": CONFIG, "steps": steps, "variants": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
