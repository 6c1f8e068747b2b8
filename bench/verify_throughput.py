"""Verifier throughput: completions scored per second by the ``math`` rule over 10 000 completions, in-process and
through the bounded pool (rewards/bounded.py, as the driver and the reward actors run it), side by side in one run.

The completions: the differential test's forms (tests/test_differential.py: markdown, LaTeX, boxed, Minerva,
GSM8K, prose; numbers, fractions, expressions, sets; right and wrong) cycled to ``--n``, and every tenth one a
chat-model arithmetic reply. ``--checkout DIR`` also times another checkout's rule in-process (the rule before a
change: ``git worktree add /tmp/old <commit>``), in a subprocess so the two never share imports.

    .venv/bin/python -m bench.verify_throughput [--n 10000] [--checkout /tmp/old]

Writes ``bench/results/verify_throughput.json`` (with the CPU and the load average: rerun above ~2.5).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def completions(n: int) -> list[tuple[str, str, dict]]:
    sys.path.insert(0, str(ROOT))
    from tests.test_differential import cases

    forms = [("What is the answer?", c, {"answer": r}) for _, c, r in cases()]
    chat = [(f"What is {a} + {a + 7}?", f"To add {a} and {a + 7}: {a} + {a + 7} = **{2 * a + 7}**.",
             {"answer": str(2 * a + 7)}) for a in range(1000)]
    return [chat[i % len(chat)] if i % 10 == 0 else forms[i % len(forms)] for i in range(n)]


def in_process(n: int) -> dict:
    from rewards.functions import math_reward

    items = completions(n)
    t0 = time.perf_counter()
    paid = sum(math_reward(*it) for it in items)
    s = time.perf_counter() - t0
    return {"seconds": round(s, 2), "per_s": round(n / s, 1), "paid": paid}


def pooled(n: int) -> dict:
    from rewards.bounded import shared_pool
    from rewards.functions import math_reward, verdicts

    items = completions(n)
    verdicts(math_reward, items[:4])  # the workers started and warm
    t0 = time.perf_counter()
    paid = sum(verdicts(math_reward, items))
    s = time.perf_counter() - t0
    return {"seconds": round(s, 2), "per_s": round(n / s, 1), "paid": paid,
            "workers": shared_pool().n, "timeouts": shared_pool().timeouts}


def other_checkout(path: str, n: int) -> dict:
    code = (f"import sys, json, logging; logging.disable(logging.WARNING); sys.path.insert(0, {path!r}); "
            f"sys.path.insert(1, {str(ROOT)!r}); from bench.verify_throughput import in_process; "
            f"import rewards; assert rewards.__file__.startswith({path!r}); print(json.dumps(in_process({n})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=path)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--checkout", help="another checkout whose rule is timed in-process too (before/after)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    from bench.common import save_result

    result = {"n": args.n, "loadavg_before": list(os.getloadavg())}
    if args.checkout:
        result["before_in_process"] = {"checkout": args.checkout, **other_checkout(args.checkout, args.n)}
    result["in_process"] = in_process(args.n)
    result["bounded_pool"] = pooled(args.n)
    save_result("verify_throughput", False, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
