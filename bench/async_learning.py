"""Learning is not hurt by the asynchronous mode: the embedded default (``configs/default.yaml``) trained in
``sync`` and in ``async`` (eta = ``rollout.max_staleness``, default 1), held-out accuracy against training minutes,
and each final policy checked outside fleetrl (:mod:`bench.outside_eval`: transformers ``generate``, greedy, the
last integer of the reply) on the same held-out prompts.

    python -m bench.async_learning [--quick] [--seeds 0 1]

Each seed sets every seed of a run (``data.seed``, ``rollout.seed``, ``trainer.seed``). Both modes run the same
actors (2 engines, 1 reward actor, 2 learner ranks) on the same 2 cores, so this is not the disaggregated layout of
:mod:`bench.async` (where the pools have cores of their own); it asks whether the accuracy reached per minute is
at least sync's when everything else is equal.
"""

from __future__ import annotations

from bench.common import parse_args, print_table, run_fleetrl, save_result

MODES = {"sync": ["rollout.mode=sync"], "async": ["rollout.mode=async"]}


def main(argv: list[str] | None = None) -> None:
    from bench.outside_eval import main as outside_eval

    args = parse_args(__doc__, argv, extra=lambda ap: ap.add_argument("--seeds", type=int, nargs="+", default=[0]))
    steps = ["trainer.total_steps=20", "trainer.eval_every=10"] if args.quick else []
    runs, table = {}, []
    for seed in args.seeds:
        for mode, extra in MODES.items():
            name = f"async_learning-{mode}-s{seed}"
            run = run_fleetrl(name, "configs/default.yaml",
                              [f"data.seed={seed}", f"rollout.seed={seed}", f"trainer.seed={seed}", *steps, *extra])
            curve, minutes = [], 0.0
            for r in run["rows"]:
                minutes += (r.get("time/step_s", 0.0) + r.get("time/eval_s", 0.0)) / 60
                if "eval/accuracy" in r:
                    curve.append((r["step"], round(minutes, 2), r["eval/accuracy"]))
            outside = outside_eval(["-c", "configs/default.yaml", "--model", f"{run['run_dir']}/final"])
            runs[name] = {"mode": mode, "seed": seed, "curve": curve, "outside_last_int": outside["last_int"],
                          "wall_s": run["wall_s"], "command": run["command"]}
            table.append([mode, seed, f"{curve[0][2]:.3f}", f"{curve[-1][2]:.3f}",
                          f"{outside['last_int']['accuracy']:.3f} +- {outside['last_int']['se']:.3f}",
                          f"{curve[-1][1]:.1f}", " ".join(f"{a:.2f}@{m:.1f}" for _, m, a in curve)])
    print_table("embedded default: sync vs async (held-out accuracy)", ["mode", "seed", "eval first", "eval last",
                "outside check (last int)", "train+eval min", "accuracy@minutes"], table)
    save_result("async_learning", args.quick, {"runs": runs})


if __name__ == "__main__":
    main()
