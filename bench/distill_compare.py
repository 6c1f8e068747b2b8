"""Three ways to make SmolLM2-135M-Instruct better at the GRPO demo's task from the same teacher, each given the
same training time on the same machine: (a) on-policy distillation (``configs/smollm2_on_policy_distill.yaml``: the
student samples, the teacher's engines score every token), (b) GRPO from the base (``configs/smollm2_arith.yaml``,
the task reward only), (c) offline distillation (``fleetrl distill``: the teacher answers, verified answers kept,
the student fine-tuned on them). The teacher is the GRPO demo's final policy (``--teacher``).

    python -m bench.distill_compare --teacher runs/smollm2_arith/final [--minutes 8] [--quick]

Every run: the demo's data, learner and engines, ``trainer.time_budget_s`` = ``--minutes`` of training (fleetrl's
eval of ``--eval-size`` held-out prompts every ``--eval-every`` steps is part of it, the same for all three);
offline distillation's teacher generation comes on top (its total minutes are reported). The base, the teacher and
each final policy are scored outside fleetrl by :mod:`bench.outside_eval` (transformers ``generate``, greedy, 200
held-out prompts); their replies are kept in ``runs/bench/distill_compare-*.jsonl`` to read.
"""

from __future__ import annotations

import json
import shutil
import time

from bench.common import PY, RUNS_DIR, parse_args, print_table, run_fleetrl, run_logged, save_result

BASE = ".fleetrl/models/smollm2-135m-instruct"
CONFIG = "configs/smollm2_arith.yaml"


def _extra(ap) -> None:
    ap.add_argument("--teacher", default="runs/smollm2_arith/final")
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--distill-prompts", type=int, default=256)


def curve_of(rows: list[dict]) -> list[tuple[int, float, float]]:
    """``(step, training minutes so far, eval/accuracy)`` at each eval."""
    out, minutes = [], 0.0
    for r in rows:
        minutes += (r.get("time/step_s", 0.0) + r.get("time/eval_s", 0.0)) / 60
        if "eval/accuracy" in r:
            out.append((r["step"], round(minutes, 2), r["eval/accuracy"]))
    return out


def outside(label: str, model: str, n: int) -> dict:
    """:mod:`bench.outside_eval` of ``model``, its replies written to ``runs/bench/distill_compare<label>.jsonl``."""
    from bench.outside_eval import main as outside_eval

    return outside_eval(["-c", CONFIG, "--model", model, "--n", str(n),
                         "--out", str(RUNS_DIR / f"distill_compare{label}.jsonl")])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, extra=_extra)
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    tag = "-quick" if args.quick else ""
    for old in RUNS_DIR.glob(f"distill_compare{tag}-*"):  # a run dir left by an earlier attempt would be reused
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    budget = 60 if args.quick else args.minutes * 60
    n_out = 20 if args.quick else 200
    common = [f"trainer.time_budget_s={budget:.0f}", "trainer.total_steps=1000",
              f"trainer.eval_every={args.eval_every}", f"data.eval_size={args.eval_size}"]
    paths = {
        "on_policy_distill": ("configs/smollm2_on_policy_distill.yaml", [f"distill.teacher={args.teacher}"]),
        "grpo": (CONFIG, []),
    }
    runs = {"base": {"outside": outside(f"{tag}-base", BASE, n_out)},
            "teacher": {"outside": outside(f"{tag}-teacher", args.teacher, n_out)}}
    for name, (config, extra) in paths.items():
        run = run_fleetrl(f"distill_compare{tag}-{name}", config, [*common, *extra], timeout_s=budget + 1200)
        runs[name] = {"curve": curve_of(run["rows"]), "wall_s": run["wall_s"], "command": run["command"],
                      "steps": sum("time/step_s" in r for r in run["rows"]),
                      "outside": outside(f"{tag}-{name}", f"{run['run_dir']}/final", n_out)}
    run_dir = RUNS_DIR / f"distill_compare{tag}-offline"
    shutil.rmtree(run_dir, ignore_errors=True)  # a benchmark starts over (an earlier run there is refused)
    cmd = [PY, "-m", "orchestrator", "distill", "-c", CONFIG, f"distill.teacher={args.teacher}",
           f"distill.prompts={16 if args.quick else args.distill_prompts}", *common, f"run.dir={run_dir}"]
    t0 = time.perf_counter()
    wall = run_logged(cmd, RUNS_DIR / f"distill_compare{tag}-offline.log", budget + 1800)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    report = json.loads((run_dir / "distill.json").read_text())
    runs["offline_distill"] = {"curve": curve_of(rows), "wall_s": wall, "command": " ".join(cmd[1:]),
                               "steps": sum("time/step_s" in r for r in rows), "teacher_data": report,
                               "outside": outside(f"{tag}-offline_distill", f"{run_dir}/final", n_out),
                               "generate_s": round(time.perf_counter() - t0 - sum(
                                   r.get("time/step_s", 0.0) + r.get("time/eval_s", 0.0) for r in rows), 1)}
    table = [[name, r.get("steps", ""), f"{r['outside']['last_int']['accuracy']:.3f} +- "
              f"{r['outside']['last_int']['se']:.3f}", " ".join(f"{a:.2f}@{m:.1f}" for _, m, a in r.get("curve", []))]
             for name, r in runs.items()]
    print_table("SmolLM2 from one teacher, equal training time", ["path", "steps", "outside check (last int)",
                "eval accuracy @ minutes"], table)
    save_result("distill_compare", args.quick, {"settings": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
