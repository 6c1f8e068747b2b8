"""Re-score saved replies with today's final-answer rule (rewards/answers.py), against the verdicts they were
published with.

Reads any mix of:
- eval sample files, ``<run.dir>/evals/step_N.jsonl`` (``prompt``, ``completion``, ``answer``, ``correct``);
- ``bench.outside_eval --out`` files (``prompt``, ``reply``, ``answer``; the verdict then is ``--rule-of``'s, or
  none);
- benchmark results, ``bench/results/*.json``, whose ``samples`` hold eval completions (``prompt``,
  ``completion``, ``correct``; the reference is the config's held-out prompt's).

For each source: how many replies, the share right as published, the share right now, and every reply whose
verdict flipped. ``--checkout DIR`` scores with another checkout's rule as well (the rule before a change), so a
source without stored verdicts (an outside_eval file) gets a before and an after.

    .venv/bin/python -m bench.rescore FILE... [--checkout /tmp/old] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def records(path: Path) -> list[dict]:
    """``{prompt, completion, answer, correct}`` per saved reply of ``path`` (``correct`` None when not stored)."""
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [{"prompt": r["prompt"], "completion": r.get("completion", r.get("reply", "")),
                 "answer": str(r["answer"]), "correct": r.get("correct")} for r in rows]
    data = json.loads(path.read_text())
    samples = [s for group in data.get("samples", {}).values() for s in group]
    answers = _answers(data.get("config")) if samples else {}
    return [{"prompt": s["prompt"], "completion": s["completion"], "answer": answers.get(s["prompt"]),
             "correct": s["correct"]} for s in samples]


def _answers(config: str | None) -> dict[str, str]:
    """The references of a config's held-out prompts, by prompt text."""
    if not config:
        return {}
    from orchestrator.recipes.pipeline import config_or_stage
    from rewards.tasks import make_task_from_config

    cfg = config_or_stage(str(ROOT / config), [])
    return {p.text: str(p.metadata["answer"]) for p in make_task_from_config(cfg.data).eval_set(cfg.data.eval_size)}


def verdicts(rows: list[dict]) -> list[bool | None]:
    from rewards.functions import math_reward, verdicts

    known = [i for i, r in enumerate(rows) if r["answer"] is not None]
    ok = verdicts(math_reward, [(rows[i]["prompt"], rows[i]["completion"], {"answer": rows[i]["answer"]})
                                for i in known])
    out: list[bool | None] = [None] * len(rows)
    for i, v in zip(known, ok):
        out[i] = v
    return out


def other_rule(checkout: str, rows: list[dict]) -> list[bool | None]:
    """The verdicts of another checkout's ``math`` rule, in a subprocess that imports only that checkout."""
    code = ("import sys, json, logging; logging.disable(logging.WARNING); "
            f"sys.path.insert(0, {checkout!r}); from rewards.functions import math_reward; "
            "rows = json.load(sys.stdin); "
            "print(json.dumps([None if r['answer'] is None else "
            "math_reward(r['prompt'], r['completion'], {'answer': r['answer']}) == 1.0 for r in rows]))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(rows), capture_output=True, text=True,
                         check=True, cwd=checkout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def share(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 4) if known else None


def rescore(path: Path, checkout: str | None) -> dict:
    rows = records(path)
    now = verdicts(rows)
    before = [r["correct"] for r in rows]
    if checkout and all(v is None for v in before):
        before = other_rule(checkout, rows)
    flipped = [{"prompt": r["prompt"], "completion": r["completion"][-300:], "answer": r["answer"], "was": b,
                "now": n} for r, b, n in zip(rows, before, now) if b is not None and n is not None and b != n]
    return {"source": str(path), "n": len(rows), "scored": sum(n is not None for n in now),
            "accuracy_published": share(before), "accuracy_now": share(now), "flipped": flipped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--checkout", help="another checkout's rule, for sources without stored verdicts")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    report = [rescore(Path(f), args.checkout) for f in args.files]
    for r in report:
        print(f"{r['source']}: {r['scored']}/{r['n']} scored; right as published {r['accuracy_published']}, "
              f"now {r['accuracy_now']}; {len(r['flipped'])} flipped")
        for f in r["flipped"]:
            print(f"  {f['was']} -> {f['now']}  answer {f['answer']}: {f['completion'][-120:]!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
