"""The DeepSeek-R1 recipes on SmolLM2-135M-Instruct, measured: ``configs/smollm2_r1.yaml`` (cold-start SFT -> GRPO
-> RFT -> GRPO -> online DPO) and ``configs/smollm2_r1_zero.yaml`` (GRPO from the base), each stage's held-out
accuracy by fleetrl's eval (``summary.json``) and by :mod:`bench.outside_eval` (transformers ``generate``, greedy).

    python -m bench.r1_recipes [--bf16] [--quick]

R1-Zero is given the wall time that R1's cold start and first GRPO stage took (its config's comparison: equal
minutes to the first RL result), unless ``--zero-minutes`` says otherwise. ``--bf16`` runs engines and learner in
bf16 (fast only on CPUs with AMX; emulated and much slower elsewhere). Replies of every outside check are kept in
``runs/bench/r1_recipes-*.jsonl`` to read.
"""

from __future__ import annotations

import json
import shutil

from bench.common import PY, RUNS_DIR, parse_args, print_table, run_logged, save_result

BASE = ".fleetrl/models/smollm2-135m-instruct"
R1, ZERO = "configs/smollm2_r1.yaml", "configs/smollm2_r1_zero.yaml"


def _extra(ap) -> None:
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--zero-minutes", type=float, default=None)
    ap.add_argument("--n", type=int, default=100, help="held-out prompts of each outside check")
    ap.add_argument("--keep", action="store_true", help="keep earlier run dirs: finished stages are not run again")


def outside(label: str, config: str, model: str, n: int) -> dict:
    from bench.outside_eval import main as outside_eval

    return outside_eval(["-c", config, "--model", model, "--n", str(n),
                         "--out", str(RUNS_DIR / f"r1_recipes{label}.jsonl")])


def pipeline(name: str, config: str, overrides: list[str], timeout_s: float) -> dict:
    """``fleetrl pipeline -c config overrides run.dir=runs/bench/<name>``; returns its summary rows and wall time."""
    run_dir = RUNS_DIR / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a benchmark starts over (a pipeline rerun would resume)
    cmd = [PY, "-m", "orchestrator", "pipeline", "-c", config, *overrides, f"run.dir={run_dir}"]
    wall = run_logged(cmd, RUNS_DIR / f"{name}.log", timeout_s)
    stages = json.loads((run_dir / "summary.json").read_text())["stages"]
    return {"command": " ".join(cmd[1:]), "wall_s": round(wall, 1), "stages": stages}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, extra=_extra)
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    tag = "-quick" if args.quick else ""
    for old in [] if args.keep else RUNS_DIR.glob(f"r1_recipes{tag}-*"):  # else resumed
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    common = ["rollout.dtype=bfloat16", "learner.mixed_precision=bfloat16"] if args.bf16 else []
    if args.quick:
        common += ["trainer.total_steps=2", "data.eval_size=8"]
    n = 8 if args.quick else args.n
    result = {"settings": vars(args), "base": outside(f"{tag}-base", R1, BASE, n), "recipes": {}}
    r1 = pipeline(f"r1_recipes{tag}-r1", R1, common, 7200)
    first_rl = sum(s["seconds"] for s in r1["stages"][:2])
    zero_s = args.zero_minutes * 60 if args.zero_minutes else first_rl
    zero = pipeline(f"r1_recipes{tag}-r1_zero", ZERO, [*common, f"trainer.time_budget_s={zero_s:.0f}"],
                    zero_s + 1800)
    for name, run, config in (("smollm2_r1", r1, R1), ("smollm2_r1_zero", zero, ZERO)):
        for st in run["stages"]:
            st["outside"] = outside(f"{tag}-{name}-{st['name']}", config, st["model"], n)
        result["recipes"][name] = run
    save_result("r1_recipes", args.quick, result)
    rows = [["base", "-", "-", f"{result['base']['last_int']['accuracy']:.3f}", "-"]]
    for name, run in result["recipes"].items():
        rows += [[name, st["name"], st["accuracy"], f"{st['outside']['last_int']['accuracy']:.3f}",
                  f"{st['seconds'] / 60:.1f}"] for st in run["stages"]]
    print_table("R1 recipes on SmolLM2", ["recipe", "stage", "fleetrl eval", "outside (last int)", "minutes"], rows)


if __name__ == "__main__":
    main()
