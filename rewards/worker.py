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
import math
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import NamedTuple

from common.actor_logs import LoggedActor
from rewards.bounded import DEFAULT_MEMORY_MB, BoundedPool, Outcome
from rewards.functions import BatchedReward, bind_reward_function

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


def _groups(items: list[tuple[str, str, dict]]) -> list[list[int]]:
    """Indices of the items of each prompt, in first-seen order (the samples of one prompt's group)."""
    by_prompt: dict[str, list[int]] = {}
    for i, (prompt, _, _) in enumerate(items):
        by_prompt.setdefault(prompt, []).append(i)
    return list(by_prompt.values())


def _describe(args: tuple) -> str:
    """A call in a timeout's log line: its completion, or a batched call's first one."""
    return str(args[1]) if isinstance(args[1], str) else f"a group of {len(args[0])}, the first: {args[0][0][1]}"


def _spread(outcomes: list[Outcome], groups: list[list[int]], batched: bool) -> list[Outcome]:
    """Per item, in item order, the outcome of its call: for a batched function the i-th value of its group's
    call, or the call's failure for every item of the group."""
    out: dict[int, Outcome] = {}
    for o, group in zip(outcomes, groups):
        for k, i in enumerate(group):
            out[i] = Outcome("ok", o.value[k]) if batched and o.ok else o
    return [out[i] for i in sorted(out)]


def _finite(value) -> float:
    """A reward function's value as a float; NaN and infinities are errors (scored 0, counted in
    ``reward/errors``), never trained on."""
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{out} is not finite")
    return out


class RewardWorker(LoggedActor):
    """Plain class; the orchestrator wraps it with ``ray.remote`` (so it is testable without Ray)."""

    def __init__(self, specs: list[tuple[str, float, dict]], timeout_s: float, strict: bool, max_threads: int = 8,
                 processes: int = 2, memory_mb: int = DEFAULT_MEMORY_MB):
        """``specs``: (name, weight, params) per function; params are bound as keyword arguments."""
        self._start_logging()
        self.fns = [(name, bind_reward_function(name, params), weight) for name, weight, params in specs]
        for _, fn, _ in self.fns:  # a function may check its prerequisites here (the code reward: its sandbox)
            if isinstance(fn, functools.partial):
                getattr(fn.func, "preflight", lambda **_: None)(**fn.keywords)
        self.timeout_s = timeout_s
        self.strict = strict
        self.errors = self.timeouts = self.scored = 0
        self._logged = False
        self.threads = ThreadPoolExecutor(max_workers=max_threads)
        self.bounded = BoundedPool(processes, timeout_s, memory_mb)

    def score(self, items: list[tuple[str, str, dict]],
              extras: list[tuple[list[int], int]] | None = None) -> ScoreBatch:
        """Score every item: the results, and how many calls raised or were stopped at the limit. ``extras``: each
        item's completion ids and policy version, for functions with TRL's signature (:class:`BatchedReward`,
        called once per prompt's group; a failed group call fails each of its items)."""
        outcomes = self._outcomes(items, extras)
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

    def _outcomes(self, items: list[tuple[str, str, dict]],
                  extras: list[tuple[list[int], int]] | None = None) -> list[list[Outcome]]:
        """Per function, the outcome of its call on every item: bounded functions in the process pool (a batched
        one once per group of items with the same prompt), the ones that bound themselves on threads."""
        bounded = [f for f, (_, fn, _) in enumerate(self.fns)
                   if not getattr(getattr(fn, "func", fn), "bounds_itself", False)]
        futures = {f: [self.threads.submit(fn, *item) for item in items]
                   for f, (_, fn, _) in enumerate(self.fns) if f not in bounded}
        groups, calls, spans = _groups(items), [], {}  # spans: function -> (its first call, items of each call)
        for j, f in enumerate(bounded):
            if isinstance(self.fns[f][1], BatchedReward):
                spans[f] = (len(calls), groups)
                calls += [(j, ([items[i] for i in g], [extras[i] for i in g] if extras else None)) for g in groups]
            else:
                spans[f] = (len(calls), [[i] for i in range(len(items))])
                calls += [(j, item) for item in items]
        flat = self.bounded.map([self.fns[f][1] for f in bounded], calls, describe=_describe) if calls else []
        out = {f: _spread(flat[first:first + len(idx)], idx, isinstance(self.fns[f][1], BatchedReward))
               for f, (first, idx) in spans.items()}
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
                if out is None:  # a batched function's "no score": left out of the sum
                    return {}, "ok"
                if isinstance(out, dict):
                    return {f"{name}/{k}": _finite(v) for k, v in out.items()}, "ok"
                return {name: _finite(out)}, "ok"
            except (TypeError, ValueError, OverflowError) as e:
                outcome = Outcome("error", f"{type(e).__name__}: returned {outcome.value!r}, not a finite number")
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
            return f"reward function {name!r} returned {outcome.value!r}, not a finite number"
        return f"reward function {name!r} raised {str(outcome.value).splitlines()[0]}"

    def close(self) -> None:
        """Stop the worker processes (they also die with this actor)."""
        self.bounded.close()

    def stats(self) -> dict:
        import os

        return {"errors": self.errors, "timeouts": self.timeouts, "scored": self.scored, "pid": os.getpid(),
                "processes": [w.proc.pid for w in self.bounded.workers]}
