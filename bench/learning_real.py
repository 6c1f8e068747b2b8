"""Learning per step and per minute on a real chat model, fleetrl against TRL's GRPOTrainer, several seeds each.

    python -m bench.learning_real [--seeds 0 1 2] [--steps 20] [--checkpoints 10 20] [--eval-size 100]
                                  [--systems fleetrl trl | fleetrl-async] [--quick]

SmolLM2-135M-Instruct on the GRPO demo's task (``configs/smollm2_arith.yaml``: "What is 17 + 5?" as a user
message in the model's chat template, operands 0-50), both systems at TRL's GRPO settings: temperature 1.0, top-p
1, no top-k, lr 1e-5 constant, AdamW (0.9, 0.999, no weight decay), grad-norm clip 1, 8 prompts x G=4, <= 32 new
tokens, clip 0.2, no KL, token-mean loss, advantages scaled by the group's std (+ 1e-4), one optimizer step per
batch, fp32 everywhere, the same prompts in the same order (step s trains on the task's ``train_batch(s, 8)`` for
the seed's prompt stream). fleetrl: 2 vLLM engines, 1 reward actor, 2 DeepSpeed ranks (the demo's layout),
``run.seed`` = the seed (prompt stream, sampling, learner), no truncated-IS weight (TRL samples with the policy
itself). TRL: :mod:`bench.trl_grpo` (``generate`` in one process, 2 threads), ``--seed`` = the seed.
``fleetrl-async``: the same fleetrl run with ``rollout.mode: async`` and ``rollout.max_staleness: 1`` (the engines
never stop; a token may come from the policy one push behind) and the truncated-IS weight its staleness needs
(``algorithm.tis_cap: 2.0``; fleetrl refuses async with a stale bound and no correction). Systems
other than the default pair write ``learning_real-<systems>.json``.

Each system saves its policy after every ``--checkpoints`` step; every saved policy, and the base once, is scored
outside both systems by :mod:`bench.outside_eval` (transformers ``generate``, greedy, ``--eval-size`` held-out
prompts; the last-integer and single-answer rules). Training minutes count training steps only (no evals, no
saves, no start-up). Reported: per system and checkpoint, the mean and sample standard deviation over seeds of the
outside accuracy and of the training minutes, and every seed's numbers.
"""

from __future__ import annotations

import json
import shutil
import statistics

from bench.common import RUNS_DIR, parse_args, print_table, run_fleetrl, run_trl, save_result

BASE = ".fleetrl/models/smollm2-135m-instruct"
CONFIG = "configs/smollm2_arith.yaml"
P, G, L, LR, T = 8, 4, 32, 1e-5, 1.0


def _extra(ap) -> None:
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--checkpoints", type=int, nargs="+", default=[10, 20])
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=["fleetrl", "trl"])


def outside(model: str, n: int, out: str) -> dict:
    from bench.outside_eval import main as outside_eval

    return outside_eval(["-c", CONFIG, "--model", model, "--n", str(n), "--out", out])


SYSTEMS = {"fleetrl": [], "fleetrl-async": ["rollout.mode=async", "rollout.max_staleness=1", "algorithm.tis_cap=2.0"],
           "trl": None}
"""System -> the fleetrl overrides of its mode (None: TRL)."""


def fleetrl_run(name: str, seed: int, steps: int, every: int, mode: list[str]) -> dict:
    """One fleetrl run; ``{step: (training minutes, policy dir)}`` at each saved checkpoint."""
    run = run_fleetrl(name, CONFIG, [
        f"run.seed={seed}", f"trainer.total_steps={steps}", "trainer.eval_every=0", f"trainer.save_every={every}",
        f"trainer.keep_checkpoints={steps // every + 1}", f"data.prompts_per_step={P}", f"rollout.group_size={G}",
        f"rollout.max_new_tokens={L}", f"rollout.temperature={T}", f"learner.lr={LR}", "algorithm.eps=1e-4",
        "algorithm.tis_cap=null", *mode], timeout_s=3600)
    out, minutes = {}, 0.0
    for row in run["rows"]:
        minutes += row.get("time/step_s", 0.0) / 60
        trained = row.get("step", -2) + 1  # row "step" counts from 0; its checkpoint is named by the steps done
        path = RUNS_DIR / name / "checkpoints" / f"step_{trained:06d}" / "policy"
        if "time/step_s" in row and (path / "config.json").exists():
            out[trained] = (minutes, str(path))
    return {"checkpoints": out, "wall_s": run["wall_s"], "command": run["command"]}


def trl_run(name: str, seed: int, steps: int, saves: list[int]) -> dict:
    report = run_trl(name, ["--model", BASE, "--chat", "--max-operand", "50", "--prompts-per-step", str(P),
                            "--group-size", str(G), "--max-tokens", str(L), "--lr", str(LR), "--temperature", str(T),
                            "--steps", str(steps), "--seed", str(seed), "--save-steps", *map(str, saves)],
                     timeout_s=3600)
    return {"checkpoints": {s["step"]: (s["train_s"] / 60, s["path"]) for s in report["saves"]},
            "wall_s": report["wall_s"], "command": report["command"]}


def summary(runs: dict, steps: list[int]) -> list[dict]:
    rows = []
    for system, by_seed in runs.items():
        for step in steps:
            acc = [r["outside"][step]["last_int"]["accuracy"] for r in by_seed.values()]
            single = [r["outside"][step]["single"]["accuracy"] for r in by_seed.values()]
            minutes = [r["minutes"][step] for r in by_seed.values()]
            rows.append({"system": system, "step": step, "seeds": len(acc), "accuracy_mean": statistics.fmean(acc),
                         "accuracy_sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                         "single_mean": statistics.fmean(single), "minutes_mean": statistics.fmean(minutes),
                         "minutes_sd": statistics.stdev(minutes) if len(minutes) > 1 else 0.0, "per_seed": acc})
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, extra=_extra)
    if args.quick:
        args.seeds, args.steps, args.checkpoints, args.eval_size = [0], 2, [2], 10
    every = args.checkpoints[0]
    if any(c % every for c in args.checkpoints) or max(args.checkpoints) > args.steps:
        raise SystemExit(f"--checkpoints {args.checkpoints}: multiples of the first, none past --steps {args.steps}")
    tag = "-quick" if args.quick else ""
    for old in [p for system in args.systems for p in RUNS_DIR.glob(f"learning_real{tag}-{system}-s*")]:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    base = outside(BASE, args.eval_size, str(RUNS_DIR / f"learning_real{tag}-base.jsonl"))
    runs: dict[str, dict] = {system: {} for system in args.systems}
    for seed in args.seeds:
        for system in runs:
            name = f"learning_real{tag}-{system}-s{seed}"
            run = (trl_run(name, seed, args.steps, args.checkpoints) if SYSTEMS[system] is None
                   else fleetrl_run(name, seed, args.steps, every, SYSTEMS[system]))
            run["minutes"] = {s: m for s, (m, _) in run["checkpoints"].items()}
            run["outside"] = {s: outside(path, args.eval_size, str(RUNS_DIR / f"{name}-step{s}.jsonl"))
                              for s, (_, path) in run["checkpoints"].items() if s in args.checkpoints}
            missing = set(args.checkpoints) - set(run["outside"])
            if missing:
                raise RuntimeError(f"{name}: no saved policy at steps {sorted(missing)}")
            del run["checkpoints"]
            runs[system][seed] = run
            print(f"{name}: " + json.dumps({s: o["last_int"]["accuracy"] for s, o in run["outside"].items()}),
                  flush=True)
    rows = summary(runs, args.checkpoints)
    print_table(f"SmolLM2 GRPO demo task, {len(args.seeds)} seeds, outside check of {args.eval_size} held-out "
                f"prompts (base {base['last_int']['accuracy']:.3f})",
                ["system", "step", "accuracy mean +- sd", "per seed", "single rule", "train minutes"],
                [[r["system"], r["step"], f"{r['accuracy_mean']:.3f} +- {r['accuracy_sd']:.3f}",
                  " ".join(f"{a:.2f}" for a in r["per_seed"]), f"{r['single_mean']:.3f}",
                  f"{r['minutes_mean']:.1f} +- {r['minutes_sd']:.1f}"] for r in rows])
    label = "" if args.systems == ["fleetrl", "trl"] else "-" + "-".join(args.systems)
    save_result(f"learning_real{label}", args.quick,
                {"settings": vars(args), "base": base, "runs": runs, "summary": rows})


if __name__ == "__main__":
    main()
