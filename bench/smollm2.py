"""A real chat model end to end: fleetrl vs TRL's GRPOTrainer on SmolLM2-135M-Instruct, side by side.

    python -m bench.smollm2 [--quick]

The demo config ``configs/smollm2_arith.yaml`` (8 prompts x G=8, responses <= 64 tokens, chat template, lr 1e-5;
fleetrl: 2 vLLM rollout actors with bf16 engines, 1 reward actor, 2 DeepSpeed ranks at ZeRO-2 with bf16 autocast,
packed token-budget micro-batches) against TRL's GRPOTrainer on the same model, prompts (the same ``train_batch``
order, as user messages rendered with the same chat template), G, response cap, sampling, learning rate and
bf16 autocast (TRL generates with transformers ``generate`` in one process with 2 threads; its vLLM modes need a
GPU). Reported per system: median seconds per step after warm-up, completions per second, peak memory (fleetrl:
every actor; TRL: its one process), and fleetrl's rollout tokens/s and weight-push seconds. Evals off in both.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import median, parse_args, print_table, run_fleetrl, run_trl, save_result, training_rows

CONFIG = "configs/smollm2_arith.yaml"
MODEL = ".fleetrl/models/smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    P, G, L, steps, trl_steps, skip = (2, 4, 32, 3, 2, 1) if args.quick else (8, 8, 64, 8, 4, 2)
    common = [f"data.prompts_per_step={P}", f"rollout.group_size={G}", f"rollout.max_new_tokens={L}"]
    fl = run_fleetrl("smollm2-fleetrl", CONFIG, [*common, f"trainer.total_steps={steps}", "trainer.eval_every=0"],
                     timeout_s=3600)
    rows = training_rows(fl["rows"], skip)
    summary = json.loads((Path(fl["run_dir"]) / "summary.json").read_text())
    learner_peak = max(v for k, v in summary["peak_rss_mb"].items() if k.startswith("learner"))
    fleet = {"step_s": median([r["time/step_s"] for r in rows]),
             "completions_per_s": median([r["throughput/samples_per_s"] for r in rows]),
             "rollout_tokens_per_s": median([r["tokens_generated"] / r["time/generate_s"] for r in rows]),
             "push_s": median([r["time/sync_s"] for r in rows]), "learn_s": median([r["time/learn_s"] for r in rows]),
             "learner_peak_rss_mb": learner_peak, "peak_rss_mb": summary["peak_rss_mb"],
             "learner_rss_by_step_mb": [r.get("memory/actor_rss_mb_max") for r in fl["rows"] if "time/step_s" in r]}
    from orchestrator.config import load_config

    max_operand = str(load_config(CONFIG).data.max_operand)  # the same prompts as the fleetrl run
    trl = run_trl("smollm2-trl", ["--model", MODEL, "--chat", "--max-operand", max_operand, "--prompts-per-step",
                                  str(P), "--group-size", str(G), "--max-tokens", str(L), "--lr", "1e-5", "--bf16",
                                  "--steps", str(trl_steps)], timeout_s=3600)
    trl_step = median([s["step_s"] for s in trl["steps"][1:]] or [trl["steps"][0]["step_s"]])
    trl_row = {"step_s": trl_step, "completions_per_s": P * G / trl_step, "peak_rss_mb": trl["peak_rss_mb"]}
    print_table(f"SmolLM2-135M-Instruct, {P} prompts x G={G}, <= {L} tokens, 2 cores",
                ["system", "s/step", "completions/s", "peak memory MB", "rollout tok/s", "push s"],
                [["fleetrl", round(fleet["step_s"], 1), round(fleet["completions_per_s"], 2),
                  f"learner rank {learner_peak:.0f} (all actors {sum(summary['peak_rss_mb'].values()):.0f})",
                  round(fleet["rollout_tokens_per_s"]), round(fleet["push_s"], 2)],
                 ["TRL GRPOTrainer", round(trl_row["step_s"], 1), round(trl_row["completions_per_s"], 2),
                  f"{trl_row['peak_rss_mb']:.0f} (one process)", "-", "-"]])
    ratio = fleet["completions_per_s"] / trl_row["completions_per_s"]
    save_result("smollm2", args.quick, {"P": P, "G": G, "L": L, "fleetrl": fleet, "trl": trl_row,
                                        "ratio_completions_per_s": ratio})


if __name__ == "__main__":
    main()
