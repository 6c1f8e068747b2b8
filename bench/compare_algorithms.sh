#!/usr/bin/env bash
# Equal-wall-time comparison of algorithms on the embedded default (README "Measured results").
# Usage: bash bench/compare_algorithms.sh [SECONDS]   -> runs/compare-<algo>/summary.json
set -euo pipefail
budget=${1:-150}
common=(trainer.total_steps=100000 "trainer.time_budget_s=$budget" trainer.eval_every=25)
run() { local name=$1; shift; .venv/bin/fleetrl train -c configs/default.yaml "${common[@]}" "run.dir=runs/compare-$name" "$@"; }
run grpo algorithm.name=grpo
run ppo algorithm.name=ppo
run rloo algorithm.name=rloo
run gdpo algorithm.name=gdpo "reward.functions=[{name: math}, {name: length, params: {max_len: 6, cache: 3}}]"
python3 - <<'PY'
import json, pathlib
print(f"{'algorithm':10} {'steps':>6} {'eval before':>12} {'eval after':>11}  peak RSS MB (learner-0 / critic-0 / rollout-0)")
for name in ("grpo", "ppo", "rloo", "gdpo"):
    s = json.loads(pathlib.Path(f"runs/compare-{name}/summary.json").read_text())
    m = s["peak_rss_mb"]
    print(f"{name:10} {s['steps']:>6} {s['eval_accuracy_first']:>12.3f} {s['eval_accuracy_last']:>11.3f}  "
          f"{m['learner-0']:.0f} / {m.get('critic-0', 0):.0f} / {m['rollout-0']:.0f}  total {sum(m.values()):.0f}")
PY
