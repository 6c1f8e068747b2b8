"""`reward-i` Ray actors: score batches of (prompt, completion, metadata) with the configured functions.

Every call runs under a hard limit (:mod:`rewards.bounded`): in a small pool of worker processes, killed and
replaced past ``reward.timeout_s`` (counted in ``reward/timeouts``, the completion logged), with their memory capped
at ``reward.memory_mb``. Functions that bound themselves (``remote``: HTTP timeouts; ``code``: its sandbox) run on
the actor's threads instead. A call that raises scores 0 and is counted in ``reward/errors`` (the first
traceback is logged); with ``reward.strict`` a raise or a timeout is fatal instead.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import NamedTuple

from common.actor_logs import LoggedActor
from rewards.bounded import DEFAULT_MEMORY_MB, BoundedPool, Outcome
from rewards.functions import load_reward_function

log = logging.getLogger("fleetrl.reward")


@dataclass
class ScoreResult:
    """Score of one completion: weighted sum and the named components it came from."""

    reward: float
    components: dict[str, float]


class ScoreBatch(NamedTuple):
    """A batch's scores, the calls that raised, the calls stopped at the time limit, and the first failure's
    one-line description (None when every call succeeded)."""

    results: list[ScoreResult]
    errors: int
    timeouts: int
    first_error: str | None = None


class RewardFunctionError(RuntimeError):
    """Raised in strict mode when a reward function fails."""


class RewardWorker(LoggedActor):
    """Plain class; the orchestrator wraps it with ``ray.remote`` (so it is testable without Ray)."""

    def __init__(self, specs: list[tuple[str, float, dict]], timeout_s: float, strict: bool, max_threads: int = 8,
                 processes: int = 2, memory_mb: int = DEFAULT_MEMORY_MB):
        """``specs``: (name, weight, params) per function; params are bound as keyword arguments."""
        self._start_logging()
        self.fns = [(name, functools.partial(load_reward_function(name), **params), weight)
                    for name, weight, params in specs]
        for _, fn, _ in self.fns:  # a function may check its prerequisites here (the code reward: its sandbox)
            getattr(fn.func, "preflight", lambda **_: None)(**fn.keywords)
        self.timeout_s = timeout_s
        self.strict = strict
        self.errors = self.timeouts = self.scored = 0
        self._logged = False
        self.threads = ThreadPoolExecutor(max_workers=max_threads)
        self.bounded = BoundedPool(processes, timeout_s, memory_mb)

    def score(self, items: list[tuple[str, str, dict]]) -> ScoreBatch:
        """Score every item: the results, and how many calls raised or were stopped at the limit."""
        outcomes = self._outcomes(items)
        results, errors, timeouts, first = [], 0, 0, None
        for i in range(len(items)):
            comps: dict[str, float] = {}
            total = 0.0
            for f, (name, _, weight) in enumerate(self.fns):
                values, status = self._value(name, outcomes[f][i])
                errors += status == "error"
                timeouts += status == "timeout"
                if status != "ok" and first is None:
                    first = self._brief(name, outcomes[f][i])
                for key, v in values.items():
                    comps[key] = v
                    total += weight * v
            results.append(ScoreResult(reward=total, components=comps))
        self.errors += errors
        self.timeouts += timeouts
        self.scored += len(items)
        return ScoreBatch(results, errors, timeouts, first)

    def _outcomes(self, items: list[tuple[str, str, dict]]) -> list[list[Outcome]]:
        """Per function, the outcome of its call on every item: bounded functions in the process pool, the ones
        that bound themselves on threads."""
        bounded = [f for f, (_, fn, _) in enumerate(self.fns) if not getattr(fn.func, "bounds_itself", False)]
        futures = {f: [self.threads.submit(fn, *item) for item in items]
                   for f, (_, fn, _) in enumerate(self.fns) if f not in bounded}
        calls = [(j, item) for j in range(len(bounded)) for item in items]
        flat = self.bounded.map([self.fns[f][1] for f in bounded], calls) if calls else []
        out = {f: flat[j * len(items):(j + 1) * len(items)] for j, f in enumerate(bounded)}
        out.update({f: [self._wait(fut) for fut in futs] for f, futs in futures.items()})
        return [out[f] for f in range(len(self.fns))]

    def _wait(self, fut) -> Outcome:
        try:
            return Outcome("ok", fut.result(timeout=self.timeout_s))
        except FutureTimeout:
            return Outcome("timeout")
        except Exception as e:  # noqa: BLE001 - a user's reward function may raise anything
            import traceback

            return Outcome("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")

    def _value(self, name: str, outcome: Outcome) -> tuple[dict[str, float], str]:
        if outcome.ok:
            try:
                out = outcome.value
                if isinstance(out, dict):
                    return {f"{name}/{k}": float(v) for k, v in out.items()}, "ok"
                return {name: float(out)}, "ok"
            except (TypeError, ValueError) as e:
                outcome = Outcome("error", f"{type(e).__name__}: returned {outcome.value!r}, not a number")
        brief = self._brief(name, outcome)
        err = brief if outcome.status == "timeout" else f"reward function {name!r} raised:\n{outcome.value}"
        if self.strict:
            log.error("%s (reward.strict=true makes this fatal)", err)
            raise RewardFunctionError(f"{brief} (reward.strict=true makes this fatal; the traceback is in this "
                                      "actor's log)")
        if outcome.status == "error" and not self._logged:
            log.error("%s (scored 0; further errors are only counted)", err)
            self._logged = True
        return {name: 0.0}, outcome.status

    def _brief(self, name: str, outcome: Outcome) -> str:
        """One line on a failed call."""
        if outcome.status == "timeout":
            return f"reward function {name!r} timed out after {self.timeout_s}s"
        if outcome.ok:  # it returned something that is not a number
            return f"reward function {name!r} returned {outcome.value!r}, not a number"
        return f"reward function {name!r} raised {str(outcome.value).splitlines()[0]}"

    def close(self) -> None:
        """Stop the worker processes (they also die with this actor)."""
        self.bounded.close()

    def stats(self) -> dict:
        import os

        return {"errors": self.errors, "timeouts": self.timeouts, "scored": self.scored, "pid": os.getpid(),
                "processes": [w.proc.pid for w in self.bounded.workers]}
