"""`reward-i` Ray actors: score batches of (prompt, completion, metadata) with the configured functions.

A function that raises or runs past ``reward.timeout_s`` scores 0 and is counted in ``reward/errors``
(the first traceback is logged); with ``reward.strict`` it is fatal instead. Scoring is concurrent over a
thread pool, so one slow call does not hold up the batch.
"""

from __future__ import annotations

import functools
import logging
import traceback
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from rewards.functions import load_reward_function
from workers.actor_logs import LoggedActor

log = logging.getLogger("fleetrl.reward")


@dataclass
class ScoreResult:
    """Score of one completion: weighted sum and the named components it came from."""

    reward: float
    components: dict[str, float]


class RewardFunctionError(RuntimeError):
    """Raised in strict mode when a reward function fails."""


class RewardWorker(LoggedActor):
    """Plain class; the orchestrator wraps it with ``ray.remote`` (so it is testable without Ray)."""

    def __init__(self, specs: list[tuple[str, float, dict]], timeout_s: float, strict: bool, max_threads: int = 8):
        """``specs``: (name, weight, params) per function; params are bound as keyword arguments."""
        self._start_logging()
        self.fns = [(name, functools.partial(load_reward_function(name), **params), weight)
                    for name, weight, params in specs]
        for _, fn, _ in self.fns:  # a function may check its prerequisites here (the code reward: its sandbox)
            getattr(fn.func, "preflight", lambda **_: None)(**fn.keywords)
        self.timeout_s = timeout_s
        self.strict = strict
        self.errors = 0
        self.scored = 0
        self._logged = False
        self.pool = ThreadPoolExecutor(max_workers=max_threads)

    def score(self, items: list[tuple[str, str, dict]]) -> tuple[list[ScoreResult], int]:
        """Score every item; returns the results and the number of failed calls in this batch."""
        futures = [[self.pool.submit(fn, p, c, m) for _, fn, _ in self.fns] for p, c, m in items]
        results, errors = [], 0
        for fut_row in futures:
            comps: dict[str, float] = {}
            total = 0.0
            for (name, _, weight), fut in zip(self.fns, fut_row):
                values, ok = self._value(name, fut)
                errors += not ok
                for key, v in values.items():
                    comps[key] = v
                    total += weight * v
            results.append(ScoreResult(reward=total, components=comps))
        self.errors += errors
        self.scored += len(items)
        return results, errors

    def _value(self, name: str, fut) -> tuple[dict[str, float], bool]:
        try:
            out = fut.result(timeout=self.timeout_s)
            if isinstance(out, dict):
                return {f"{name}/{k}": float(v) for k, v in out.items()}, True
            return {name: float(out)}, True
        except FutureTimeout:
            err = brief = f"reward function {name!r} timed out after {self.timeout_s}s"
        except Exception as e:  # noqa: BLE001 - a user's reward function may raise anything
            err = f"reward function {name!r} raised:\n{traceback.format_exc()}"
            brief = f"reward function {name!r} raised {type(e).__name__}: {e}"
        if self.strict:
            log.error("%s (reward.strict=true makes this fatal)", err)
            raise RewardFunctionError(f"{brief} (reward.strict=true makes this fatal; the traceback is in this "
                                      "actor's log)")
        if not self._logged:
            log.error("%s (scored 0; further errors are only counted)", err)
            self._logged = True
        return {name: 0.0}, False

    def stats(self) -> dict:
        import os

        return {"errors": self.errors, "scored": self.scored, "pid": os.getpid()}
