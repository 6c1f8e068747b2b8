"""End to end: fleetrl GRPO vs TRL's GRPOTrainer, seconds per step and completions per second.

    python -m bench.end_to_end [--quick]

Two cases at identical model, task, prompts per step, G, completion cap, sampling, learning rate and epochs:

* ``small``: the embedded default (0.6 M params, 16 prompts x G=8, answers of <= 8 tokens): per-step overhead.
* ``gen_heavy``: ``configs/gen_heavy.yaml`` (~24 M params, 8 prompts x G=8, exactly 128 tokens each).

fleetrl runs as ``python -m orchestrator train -c <config>`` (2 vLLM rollout actors, 1 reward actor, 2 DeepSpeed
ranks), once per variant in ``VARIANTS``; TRL runs in one process with 2 torch threads (:mod:`bench.trl_grpo`).
On ``gen_heavy`` both run twice by precision: all fp32 (like for like), and mixed (fleetrl: bf16 compiled
engines, bf16 autocast in the learner, fp32 weights and optimizer; TRL: its ``bf16=True``). Each system's first
steps are warm-up and dropped; the median of the rest is reported. Start-up (Ray, engines, DeepSpeed; TRL's
imports) is excluded from both.
"""

from __future__ import annotations

from bench.build_models import model_path
from bench.common import (
    fleetrl_supports,
    load_result,
    median,
    parse_args,
    print_table,
    require_model,
    run_fleetrl,
    run_trl,
    save_result,
    training_rows,
)

EMBEDDED = ".fleetrl/models/arith-base"

# name: config file, model (path, bench preset or None), P, G, L, fleetrl steps, TRL steps, warm-up steps dropped
FULL = {
    "small": dict(config="configs/default.yaml", model=EMBEDDED, preset=None, P=16, G=8, L=8, steps=20,
                  trl_steps=30, skip=5),
    "gen_heavy": dict(config="configs/gen_heavy.yaml", model=str(model_path("gen-heavy")), preset="gen-heavy",
                      P=8, G=8, L=128, steps=6, trl_steps=5, skip=1),
}
QUICK = {
    "small": dict(FULL["small"], steps=4, trl_steps=4, skip=1),
    "gen_heavy": dict(FULL["gen_heavy"], model=str(model_path("gen-tiny")), preset="gen-tiny", P=4, G=4, L=32,
                      steps=3, trl_steps=3, skip=1),
}
LR = 3e-5


FP32 = ["rollout.dtype=float32", "rollout.enforce_eager=true", "learner.mixed_precision=null"]
BF16 = ["rollout.dtype=bfloat16", "rollout.enforce_eager=false", "learner.mixed_precision=bfloat16"]
# fleetrl variants per case: (label, mode, overrides). gen_heavy.yaml itself is the bf16 one; the fp32 variant is
# the like-for-like match for TRL's fp32 run.
VARIANTS = {
    "small": [("sync", "sync", []), ("one_step_off", "one_step_off", [])],
    "gen_heavy": [("sync, fp32", "sync", FP32), ("sync, fp32, padded", "sync", FP32 + ["learner.packing=false"]),
                  ("sync, bf16 engines + autocast", "sync", BF16), ("one_step_off, bf16", "one_step_off", BF16)],
}


def fleetrl_case(name: str, c: dict, label: str, mode: str, extra: list[str]) -> dict:
    """One fleetrl run; per-step medians of its metrics after the warm-up steps."""
    overrides = [f"model.path={c['model']}", f"data.prompts_per_step={c['P']}", f"rollout.group_size={c['G']}",
                 f"rollout.max_new_tokens={c['L']}", f"learner.lr={LR}", "learner.epochs=1",
                 f"trainer.total_steps={c['steps']}", "trainer.eval_every=0", *extra]
    if mode != "sync":
        overrides.append(f"rollout.mode={mode}")
    slug = label.split(",")[0] + ("-bf16" if "bf16" in label else "") + ("-padded" if "padded" in label else "")
    run = run_fleetrl(f"e2e-{name}-fleetrl-{slug}", c["config"], overrides)
    rows = training_rows(run["rows"], c["skip"])
    step_s = median(r["time/step_s"] for r in rows)
    out = {"system": f"fleetrl ({label})", "step_s": step_s, "completions_per_s": c["P"] * c["G"] / step_s,
           "tokens_per_s": median(r["tokens_generated"] / r["time/step_s"] for r in rows),
           "mean_len": median(r["response/length_mean"] for r in rows), "steps_measured": len(rows),
           "command": run["command"]}
    for key in ("time/generate_s", "time/generate_overlapped_s", "time/logprobs_s", "time/learn_s", "time/sync_s",
                "time/overhead_s", "time/rollout_wait_s"):
        if any(key in r for r in rows):
            out[key] = median(r.get(key, 0.0) for r in rows)
    # one_step_off generates the next batch while the learner trains: ideal step = the longer of the two
    out["generate_s"] = out.get("time/generate_s", 0.0) + out.get("time/generate_overlapped_s", 0.0)
    out["learner_s"] = out.get("time/logprobs_s", 0.0) + out.get("time/learn_s", 0.0)
    out["step_over_max_gen_learner"] = step_s / max(out["generate_s"], out["learner_s"], 1e-9)
    return out


def trl_case(name: str, c: dict, bf16: bool = False) -> dict:
    """One TRL run; median step seconds after the warm-up steps (timed by the bench callback). ``bf16``: TRL's
    own mixed precision (``bf16=True``: autocast in training)."""
    report = run_trl(f"e2e-{name}-trl" + ("-bf16" if bf16 else ""), [
        "--model", c["model"], "--prompts-per-step", str(c["P"]), "--group-size", str(c["G"]),
        "--max-tokens", str(c["L"]), "--lr", str(LR), "--epochs", "1", "--steps", str(c["trl_steps"]),
        *(["--bf16"] if bf16 else [])])
    steps = report["steps"][c["skip"]:]
    lens = [float(x["completions/mean_length"]) for x in report["logs"] if "completions/mean_length" in x]
    step_s = median(s["step_s"] for s in steps)
    return {"system": "TRL GRPOTrainer" + (" (bf16)" if bf16 else " (fp32)"), "step_s": step_s,
            "completions_per_s": c["P"] * c["G"] / step_s,
            "tokens_per_s": c["P"] * c["G"] * median(lens[c["skip"]:]) / step_s,
            "mean_len": median(lens[c["skip"]:]), "steps_measured": len(steps), "command": report["command"],
            # TRL's step split by bench.trl_grpo: generation + scoring, and the rest (the update)
            "generate_s": median(s["generate_s"] for s in steps), "learner_s": median(s["learner_s"] for s in steps)}


def main(argv: list[str] | None = None) -> int:
    def extra(ap):
        ap.add_argument("--case", choices=list(FULL), help="run one case only (the other's last results are kept)")
        ap.add_argument("--fp32-only", action="store_true",
                        help="skip the bf16 runs (on a CPU without AMX / AVX512-BF16 bf16 is emulated, tens of times "
                             "slower)")

    args = parse_args(__doc__, argv, extra)
    cases = QUICK if args.quick else FULL
    if args.case:
        cases = {args.case: cases[args.case]}
    modes = ["sync"] + (["one_step_off"] if fleetrl_supports("rollout.mode=one_step_off") else [])
    results, rows = {}, []
    for name, c in cases.items():
        require_model(c["model"], c["preset"])
        trl = trl_case(name, c)
        trls = [trl] + ([trl_case(name, c, bf16=True)] if name == "gen_heavy" and not args.fp32_only else [])
        variants = [v for v in VARIANTS[name] if v[1] in modes and not (args.fp32_only and "bf16" in v[0])]
        runs = [fleetrl_case(name, c, *v) for v in variants] + trls
        results[name] = {"settings": {**c, "lr": LR}, "runs": runs}
        for r in runs:
            rows.append([name, r["system"], r["step_s"], r["completions_per_s"], r["tokens_per_s"], r["mean_len"],
                         r["completions_per_s"] / trl["completions_per_s"],
                         r["completions_per_s"] / trls[-1]["completions_per_s"], r.get("generate_s", ""),
                         r.get("learner_s", ""), r.get("step_over_max_gen_learner", ""), r.get("time/overhead_s", "")])
    print_table("end to end: fleetrl GRPO vs TRL GRPOTrainer (median over measured steps)",
                ["case", "system", "s/step", "completions/s", "tokens/s", "mean completion len", "vs TRL fp32",
                 "vs TRL bf16 (gen_heavy)",
                 "generate s", "learner s", "step / max(gen, learner)", "overhead s"], rows)
    if args.case:  # keep the other case's last results
        previous = load_result("end_to_end", args.quick)
        results = {**{k: v for k, v in previous.items() if k in FULL}, **results}
    save_result("end_to_end", args.quick, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
