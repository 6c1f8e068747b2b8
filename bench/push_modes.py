"""Weight push on the embedded default: Ray object store vs a gloo collective group (`rollout.weight_sync`).

Runs the embedded default (2 rollout engines, 2 learner ranks at ZeRO-2) for N steps with each push mode, back to
back, and reports the median per-step push time and its share of the step. Writes bench/results/push_modes.json.

    .venv/bin/python bench/push_modes.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(mode: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1")
        env.pop("RAY_ADDRESS", None)
        cmd = [sys.executable, "-m", "orchestrator", "train", "-c", "configs/default.yaml", f"run.dir={tmp}/run",
               f"trainer.total_steps={steps}", "trainer.eval_every=0", f"rollout.weight_sync={mode}"]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/sync_s" in r][2:]  # skip warm-up (group formation, first reloads)
    sync = statistics.median(r["time/sync_s"] for r in rows)
    step = statistics.median(r["time/step_s"] for r in rows)
    return {"mode": mode, "steps": len(rows), "push_s_median": sync, "step_s_median": step,
            "push_share": sync / step, "engine_reload_s_median": statistics.median(
                r["weight_sync/engine_reload_s"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    results = [run(mode, args.steps) for mode in ("object_store", "collective")]
    print(f"{'push mode':<14}{'push s':>9}{'reload s':>10}{'step s':>9}{'push/step':>11}")
    for r in results:
        print(f"{r['mode']:<14}{r['push_s_median']:>9.3f}{r['engine_reload_s_median']:>10.3f}"
              f"{r['step_s_median']:>9.3f}{r['push_share']:>10.1%}")
    out = ROOT / "bench" / "results" / "push_modes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
