"""LoRA against full fine-tuning on SmolLM2-135M-Instruct (the demo task, ``configs/smollm2_arith_lora.yaml``):
learner seconds per step, the learner ranks' peak RSS, push bytes and seconds, for full weights and LoRA ranks 8,
32 and 128 on every linear layer (alpha = 2 x rank) with the merged push, and ranks 8 and 32 with the adapter push
(the engines serve base + adapter through vLLM's LoRA kernels: generation seconds per step in the table too), each
a real ``fleetrl train`` run (vLLM engines, DeepSpeed ranks, Ray) of a few steps with evals off.

    python -m bench.lora [--quick] [--steps N] [--only LABEL ...]

The first step of each run is a warm-up and is dropped; the numbers are medians over the rest. Peak RSS is the
largest rank's ``ru_maxrss``; on the rank that puts the merged weights into Ray's object store it includes the
store's pages that rank wrote (the last two pushes: the pool keeps the last one for a new engine), reported
beside it. Writes ``bench/results/lora.json`` (``--only``: those variants are measured again and replace theirs
in the file, each variant records its commit); docs/BENCHMARKS.md's table is generated from it (``python -m
bench.tables``). Held-out accuracy against wall-clock time, full vs LoRA: ``python -m bench.smollm2_demo --config
configs/smollm2_arith_lora.yaml`` beside the full fine-tuning demo (two ~45-minute runs).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import (
    RESULTS_DIR,
    commit_id,
    median,
    parse_args,
    print_table,
    require_model,
    run_fleetrl,
    save_result,
    training_rows,
)

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
    # lower-memory settings: half the tokens per micro-batch (half the activations), and activations recomputed
    # layer by layer in backward
    "LoRA r=32, 256-token micro-batches": ["learner.lora.rank=32", "learner.lora.alpha=64",
                                           "learner.micro_batch_tokens=256"],
    "LoRA r=32, 256-token micro-batches, gradient checkpointing": [
        "learner.lora.rank=32", "learner.lora.alpha=64", "learner.micro_batch_tokens=256",
        "learner.gradient_checkpointing=true"],
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
        "shmem_mb": round(max((r.get("memory/actor_shmem_mb_max", 0) for r in run["rows"]), default=0)),
        "rank_peak_rss_mb": rank_peaks(run["run_dir"]),
        "push_mb": round(rows[-1]["weight_sync/bytes"] / 2**20, 2),
        "push_s": round(median(r["time/sync_s"] for r in rows), 3),
        "probe_max": max(r["weight_sync/logprob_max_diff"] for r in run["rows"]
                         if "weight_sync/logprob_max_diff" in r),
        "steps": len(rows), "wall_s": round(run["wall_s"], 1), "command": run["command"], "commit": commit_id(),
    }


def rank_peaks(run_dir: str) -> list[int]:
    """Each learner rank's peak RSS over the whole run (the run summary's; rank 0's includes the final export)."""
    peaks = json.loads((Path(run_dir) / "summary.json").read_text())["peak_rss_mb"]
    return [round(v) for k, v in sorted(peaks.items()) if k.startswith("learner-")]


def table(results: dict, commit: str = "") -> tuple[list[str], list[list]]:
    """The docs table; ``commit``: the result file's, for variants that do not record their own."""
    full = results["full fine-tuning"]
    headers = ["variant", "learner s/step", "x full (speed)", "peak RSS MB per rank", "of it object-store pages MB",
               "whole run: rank 0 / rank 1 MB",
               "push MB", "% of full push", "push s (incl. probe)", "probe max \\|dlogp\\|", "generate s/step",
               "step s", "commit"]
    rows = [[label, r["learner_s"], round(full["learner_s"] / r["learner_s"], 2), r["peak_rss_mb"],
             r.get("shmem_mb", "not recorded"), " / ".join(map(str, r.get("rank_peak_rss_mb", ["not recorded"]))),
             r["push_mb"], round(100 * r["push_mb"] / full["push_mb"], 1),
             r["push_s"], f"{r['probe_max']:.1e}", r["generate_s"], r["step_s"], r.get("commit", commit)]
            for label, r in results.items()]
    return headers, rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, lambda ap: (ap.add_argument("--steps", type=int, default=3),
                                                 ap.add_argument("--only", nargs="+", choices=list(VARIANTS))))
    require_model(MODEL)
    steps = 2 if args.quick else args.steps
    saved = RESULTS_DIR / f"lora{'-quick' if args.quick else ''}.json"
    results = {}
    if args.only and saved.exists():  # the variants not measured again keep their own commit
        old = json.loads(saved.read_text())
        results = {label: {"commit": old["meta"]["commit"], **r}
                   for label, r in old["variants"].items()}
    results.update({label: measure(label, steps) for label in args.only or VARIANTS})
    results = {label: results[label] for label in VARIANTS if label in results}
    print_table("LoRA vs full fine-tuning, SmolLM2-135M-Instruct", *table(results))
    save_result("lora", args.quick, {"config": CONFIG, "steps": steps, "variants": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
