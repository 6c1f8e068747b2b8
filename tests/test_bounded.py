"""Bounded verification (rewards/bounded.py): completions that keep math-verify computing for minutes are stopped
at the limit, counted, and scored wrong; the other verdicts of their batch are unchanged; nothing is left running.
Through the driver's correctness path (:func:`rewards.functions.verdicts`) and through a real reward actor (Ray)."""

import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rewards.bounded import BoundedPool
from rewards.functions import math_reward
from tests.conftest import subprocess_env

HANGING = [  # each ran > 40 s in math-verify against a symbolic reference (before the hard time limit)
    ("\\boxed{10^{10^{10}}}", "2\\sqrt{3}"), ("\\boxed{9^{9^{9^{9}}}}", "2\\sqrt{3}"),
    ("\\boxed{(x+1)^{100000}}", "2\\sqrt{3}"),
]
NESTED = ("\\boxed{" * 10_000 + "42" + "}" * 10_000, "42")  # quadratic in the old box scan: > 30 s
LIMIT_S = 2.0
MARGIN_S = 20.0
"""A replacement worker's start-up (imports) per stopped call, on 2 cores that the other xdist lane shares (14.3 s in
all under `make coverage`, whose tracer runs in every process); a completion the limit does not stop runs > 40 s."""


def batch() -> list[tuple[str, str, dict]]:
    normal = [(f"What is {i} + {i}?", c, {"answer": str(2 * i)})
              for i in range(20) for c in (f"The answer is **{2 * i}**.", f"\\boxed{{{2 * i + 1}}}")]
    hard = [("Simplify.", c, {"answer": ref}) for c, ref in HANGING + [NESTED]]
    return normal[:20] + hard + normal[20:]


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


def bounded_children() -> list[int]:
    """This process's worker processes still running (stopped ones included: a call abandoned, not killed)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "rewards.bounded" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def test_the_nested_box_is_read_in_linear_time():
    t0 = time.perf_counter()
    assert math_reward("q", *NESTED[:1], {"answer": "42"}) == 0.0  # an answer inside 10 000 boxes is no number
    assert time.perf_counter() - t0 < 2.0


def test_the_driver_path_stops_hanging_completions_and_leaves_nothing_running(monkeypatch):
    import rewards.bounded as bounded
    from rewards.functions import verdicts

    before = set(bounded_children())  # an earlier test's shared pool, in this process, is not this test's
    pool = BoundedPool(workers=2, timeout_s=LIMIT_S)
    monkeypatch.setattr(bounded, "_shared", pool)
    threads = threading.active_count()
    items = batch()
    t0 = time.perf_counter()
    got = verdicts(math_reward, items)
    elapsed = time.perf_counter() - t0
    hard = set(range(20, 20 + len(HANGING) + 1))
    expected = [math_reward(p, c, m) == 1.0 for i, (p, c, m) in enumerate(items) if i not in hard]
    assert [v for i, v in enumerate(got) if i not in hard] == expected and sum(expected) == 20
    assert not any(got[i] for i in hard)
    assert pool.timeouts == len(HANGING)
    assert elapsed < LIMIT_S + MARGIN_S, elapsed
    pool.close()
    time.sleep(0.2)
    assert set(bounded_children()) - before == set() and threading.active_count() <= threads


def test_a_call_past_the_memory_limit_is_an_error_not_a_crash():
    pool = BoundedPool(workers=1, timeout_s=10, memory_mb=512)
    try:
        (out,) = pool.map([bytearray], [(0, (1 << 31,))])
        assert out.status == "error" and "memory" in out.value
        (again,) = pool.map([math_reward], [(0, ("q", "7", {"answer": "7"}))])
        assert again.ok and again.value == 1.0
    finally:
        pool.close()


ACTOR_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import ray
    sys.path.insert(0, os.getcwd())
    from rewards.worker import RewardWorker
    from tests.test_bounded import LIMIT_S, batch

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    actor = ray.remote(RewardWorker).options(num_cpus=0.25).remote([("math", 1.0, {})], LIMIT_S, False)
    ray.get(actor.score.remote(batch()[:2]))  # started and warm
    t0 = time.perf_counter()
    results, errors, timeouts, _ = ray.get(actor.score.remote(batch()))
    elapsed = time.perf_counter() - t0
    pids = ray.get(actor.stats.remote())["processes"]
    ray.kill(actor, no_restart=True)
    print(json.dumps({"rewards": [r.reward for r in results], "errors": errors, "timeouts": timeouts,
                      "elapsed": elapsed, "pids": pids}))
""")


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_a_real_reward_actor_stops_hanging_completions_and_dies_with_its_processes():
    from tests.conftest import shared_ray_env
    from tests.test_e2e import ROOT

    env = subprocess_env(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", **shared_ray_env())
    proc = subprocess.run([sys.executable, "-c", ACTOR_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    items = batch()
    hard = range(20, 20 + len(HANGING) + 1)
    expected = [math_reward(p, c, m) for i, (p, c, m) in enumerate(items) if i not in hard]  # never the hanging
    assert [r for i, r in enumerate(out["rewards"]) if i not in hard] == expected
    assert out["timeouts"] == len(HANGING) and out["errors"] == 0
    assert out["elapsed"] < LIMIT_S + MARGIN_S, out["elapsed"]
    deadline = time.time() + 20
    while alive(out["pids"]) and time.time() < deadline:
        time.sleep(0.5)
    assert out["pids"] and alive(out["pids"]) == []
