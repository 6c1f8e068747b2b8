"""Learning speed: held-out greedy accuracy against training wall-clock time, fleetrl vs TRL's GRPOTrainer.

    python -m bench.learning_speed [--quick] [--budget SECONDS]

Both start from the embedded checkpoint (``.fleetrl/models/arith-base``) and train GRPO on the embedded default
(16 prompts x G=8, 8-token answers, lr 3e-5, the same prompt stream) for the same budget of training seconds.
Both are evaluated the same way: greedy decoding of the 400 held-out prompts of ``ArithmeticTask().eval_set(400)``
scored by ``rewards.functions.math_reward`` (fleetrl through its vLLM engines, TRL's model in ``eval()`` mode with
HF ``generate``). The x axis is training time: the sum of the steps' ``time/step_s`` for fleetrl and the trainer's
wall clock minus eval time for TRL; start-up is excluded from both, and each curve ends at its first eval at or
past the budget. Writes the plot to ``bench/results/learning_speed.png``.
"""

from __future__ import annotations

from bench.common import RESULTS_DIR, parse_args, print_table, require_model, run_fleetrl, run_trl, save_result

EMBEDDED = ".fleetrl/models/arith-base"
FULL = dict(budget=90.0, fleetrl_eval_every=10, trl_eval_every=30)
QUICK = dict(budget=15.0, fleetrl_eval_every=5, trl_eval_every=5)
LR = 3e-5
TRL_MAX_STEPS = 3000  # a cap above what the budget allows (~0.15 s/step); its prompt dataset is built up front


def fleetrl_curve(s: dict, tag: str) -> dict:
    """fleetrl's ``trainer.time_budget_s`` counts eval time too, so it gets a margin and the curve is cut after."""
    run = run_fleetrl(f"learn-fleetrl{tag}", "configs/default.yaml", [
        f"model.path={EMBEDDED}", f"learner.lr={LR}", "trainer.total_steps=100000",
        f"trainer.time_budget_s={s['budget'] * 1.2 + 10:.0f}", f"trainer.eval_every={s['fleetrl_eval_every']}"])
    t, curve = 0.0, []
    for row in sorted(run["rows"], key=lambda r: r["step"]):
        if "eval/accuracy" in row:  # the eval of step s runs before step s trains
            curve.append({"step": row["step"], "train_s": t, "accuracy": row["eval/accuracy"]})
        t += row.get("time/step_s", 0.0)
    return {"system": "fleetrl", **cut(curve, s["budget"]), "command": run["command"]}


def trl_curve(s: dict, tag: str) -> dict:
    report = run_trl(f"learn-trl{tag}", [
        "--model", EMBEDDED, "--prompts-per-step", "16", "--group-size", "8", "--max-tokens", "8",
        "--lr", str(LR), "--steps", str(TRL_MAX_STEPS), "--time-budget", str(s["budget"]),
        "--eval-every", str(s["trl_eval_every"])])
    curve = [{k: e[k] for k in ("step", "train_s", "accuracy")} for e in report["evals"]]
    return {"system": "TRL GRPOTrainer", **cut(curve, s["budget"]), "command": report["command"]}


def cut(curve: list[dict], budget: float) -> dict:
    """The evals before ``budget`` training seconds and the first one at or past it; the steps and seconds
    trained up to that last eval."""
    kept = [c for c in curve if c["train_s"] < budget] + [c for c in curve if c["train_s"] >= budget][:1]
    return {"curve": kept, "steps": kept[-1]["step"], "train_s": kept[-1]["train_s"]}


def accuracy_at(curve: list[dict], t: float) -> float:
    """The latest eval at or before training second ``t``."""
    seen = [c["accuracy"] for c in curve if c["train_s"] <= t + 1e-9]
    return seen[-1] if seen else float("nan")


def plot(results: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([c["train_s"] for c in r["curve"]], [c["accuracy"] for c in r["curve"]], "o-",
                label=f"{r['system']} ({r['steps']} steps)")
    ax.set_xlabel("training wall-clock seconds (evals and start-up excluded)")
    ax.set_ylabel("held-out greedy accuracy (400 prompts)")
    ax.set_ylim(0, max(0.6, max(c["accuracy"] for r in results for c in r["curve"]) + 0.05))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("GRPO on the embedded default: accuracy vs training time")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, lambda ap: ap.add_argument(
        "--budget", type=float, default=None, help="training seconds per system (default 90; --quick 15)"))
    s = dict(QUICK if args.quick else FULL)
    if args.budget is not None:
        s["budget"] = args.budget
    tag = "-quick" if args.quick else ""
    require_model(EMBEDDED)
    results = [fleetrl_curve(s, tag), trl_curve(s, tag)]
    marks = [round(s["budget"] * f) for f in (0.25, 0.5, 0.75)]
    rows = [[r["system"], r["steps"], r["train_s"] / max(r["steps"], 1), r["curve"][0]["accuracy"],
             *[accuracy_at(r["curve"], t) for t in marks], r["curve"][-1]["accuracy"], r["train_s"],
             max(c["accuracy"] for c in r["curve"])] for r in results]
    print_table(f"learning speed: embedded default, {s['budget']:.0f} s of training each",
                ["system", "steps", "s/step", "eval at 0 s", *[f"eval at {t} s" for t in marks], "final eval",
                 "final eval at s", "best eval"], rows)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    png = RESULTS_DIR / f"learning_speed{tag}.png"
    plot(results, png)
    print(f"wrote {png}")
    save_result("learning_speed", args.quick, {"settings": {**s, "lr": LR}, "runs": results, "plot": str(png)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
