"""The SmolLM2 demo, measured two ways: fleetrl's own held-out evals of a `configs/smollm2_arith.yaml` run, and the
outside evaluator (:mod:`bench.outside_eval`: transformers ``generate``, greedy, plain integer rules) on the base
model and on the run's final policy.

    python -m bench.smollm2_demo [--train] [--config configs/smollm2_arith.yaml] [--run DIR] [--rescore]
    python -m bench.smollm2_demo --train --config configs/smollm2_arith_lora.yaml   # the LoRA demo, same budget

``--train`` first runs ``fleetrl train -c CONFIG`` (about 45 minutes on 2 cores); without it the run directory
(default: ``runs/<config name>``) must hold a finished run. Writes ``bench/results/smollm2_demo.json`` (for
``configs/smollm2_arith_lora.yaml``: ``smollm2_demo_lora.json``; the eval curve, the step times, both evaluators'
accuracies and a sample of what the model writes before and after), from which docs/BENCHMARKS.md's tables are
generated (``python -m bench.tables``; the LoRA file's beside the full fine-tuning run's, at equal wall-clock).
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

from bench.common import PY, SUBPROCESS_ENV, parse_args, save_result
from bench.outside_eval import main as outside_eval

CONFIG = "configs/smollm2_arith.yaml"


def curve(run: Path) -> tuple[list[dict], list[dict]]:
    """fleetrl's evals (step, minutes of training and evals since step 0, accuracy, restate share) and steps."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals, minutes = [], 0.0
    for r in rows:
        if "eval/accuracy" in r:
            evals.append({"step": r["step"], "minutes": round(minutes / 60, 2), "eval_accuracy": r["eval/accuracy"],
                          "restate_frac": r.get("eval/restate_frac")})
        minutes += r.get("time/step_s", 0.0) + r.get("time/eval_s", 0.0)
    steps = [{k: r[k] for k in ("step", "time/step_s", "time/generate_s", "time/learn_s", "train/accuracy",
                                "response/length_mean") if k in r} for r in rows if "time/step_s" in r]
    return evals, steps


def samples(path: Path, n: int = 5) -> list[dict]:
    """The first ``n`` eval completions of a fleetrl eval file."""
    rows = [json.loads(line) for line in path.read_text().splitlines()][:n]
    return [{"prompt": r["prompt"].split("user\n")[-1].split("<|im_end|>")[0], "completion": r["completion"],
             "correct": r["correct"]} for r in rows]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, lambda ap: (
        ap.add_argument("--train", action="store_true"), ap.add_argument("--config", default=CONFIG),
        ap.add_argument("--run", help="the run directory (default runs/<config name>)"),
        ap.add_argument("--rescore", action="store_true", help="score the saved outside replies again")))
    config = Path(args.config)
    run = Path(args.run or f"runs/{config.stem}")
    if args.train:
        subprocess.run([PY, "-m", "orchestrator", "train", "-c", str(config), f"run.dir={run}", "--overwrite"],
                       check=True,
                       env={**__import__("os").environ, **SUBPROCESS_ENV})
    summary = json.loads((run / "summary.json").read_text())
    evals, steps = curve(run)
    outside = {}
    for name, model in (("base", []), ("final", ["--model", str(run / "final")])):
        out = run / f"outside_{name}.jsonl"
        again = ["--rescore", str(out)] if args.rescore and out.exists() else []
        outside[name] = outside_eval(["-c", str(config), *model, "--out", str(out), *again])
    eval_files = sorted((run / "evals").glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))
    save_result("smollm2_demo" + config.stem.removeprefix("smollm2_arith"), args.quick, {
        "config": str(config), "run": str(run), "summary": summary, "evals": evals,
        "median_step_s": statistics.median(s["time/step_s"] for s in steps), "steps": steps,
        "outside": outside,
        "samples": {"first_eval": samples(eval_files[0]), "last_eval": samples(eval_files[-1])}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
