"""A discrete-event model of the three rollout modes: where time goes when generation and training take
turns (``sync``), overlap by one batch (``one_step_off``), or never wait for each other (``async`` with partial
rollouts and a staleness bound eta).

The model, per engine: continuous batching of at most ``max_seqs`` sequences; one decode step costs
``step_s + per_seq_s * active`` and gives every active sequence one token. The learner trains a batch in
``train_s + per_token_s * tokens``; a push stops every engine for ``push_s`` (in ``async`` the sequences in flight
are paused, then go on with the new weights: partial rollouts). Completion lengths come from ``lengths(rng)``.

- ``sync``: batch k is generated (all engines), then trained, then pushed; the engines idle while the learner works.
- ``one_step_off``: batch k+1 is generated while batch k trains; the push waits for batch k+1 to finish (fleetrl's
  rule: the engines finish the next batch before they reload), then batch k+2 starts.
- ``async``: a group ``g`` is admitted once ``g // prompts_per_step <= version + eta`` (AReaL's capacity rule); the
  engines fill free slots from the admitted groups; the learner takes the first ``prompts_per_step`` groups to
  complete; a token's staleness is the learner's version when trained minus the version that sampled it.
  ``eta = 0`` admits a batch only after the previous push: it is ``sync``.

Pure Python, no fleetrl import: ``python -m bench.async_sim`` prints the table of its built-in cases.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Costs:
    engines: int
    max_seqs: int  # concurrent sequences per engine
    step_s: float  # a decode step's fixed cost
    per_seq_s: float  # and its cost per active sequence
    train_s: float  # a learner step's fixed cost
    per_token_s: float  # and its cost per trained token
    push_s: float  # engines stopped while weights load


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int
    group_size: int
    lengths: Callable[[random.Random], int]
    steps: int


@dataclass
class Result:
    mode: str
    eta: int
    wall_s: float
    completions: int
    engine_busy_s: float
    learner_busy_s: float
    staleness: list[int] = field(default_factory=list)  # per trained token
    partial: int = 0  # samples a push met mid-generation
    dropped: int = 0  # samples with a token older than eta versions when their batch was taken (async)

    @property
    def completions_per_s(self) -> float:
        return self.completions / self.wall_s

    def idle(self, costs: Costs) -> tuple[float, float]:
        """(engine idle ratio, learner idle ratio) over the wall time."""
        return 1 - self.engine_busy_s / (costs.engines * self.wall_s), 1 - self.learner_busy_s / self.wall_s


@dataclass
class _Seq:
    group: int
    left: int
    versions: list[int] = field(default_factory=list)


class _Sim:
    def __init__(self, mode: str, eta: int, costs: Costs, work: Workload, seed: int):
        self.mode, self.eta, self.c, self.w = mode, eta, costs, work
        self.rng = random.Random(seed)
        self.version = 0
        self.now = 0.0
        self.events: list = []  # (time, order, kind, payload)
        self.order = 0
        self.active: list[list[_Seq]] = [[] for _ in range(costs.engines)]
        self.stepping = [False] * costs.engines
        self.paused_until = 0.0
        self.queue: list[_Seq] = []  # admitted, not started
        self.next_group = 0
        self.open = 0  # groups admitted so far may not exceed this
        self.left_in_group: dict[int, int] = {}
        self.tokens_in_group: dict[int, list[list[int]]] = {}
        self.complete: list[int] = []  # groups complete, in completion order
        self.learner_busy = False
        self.push_pending = False
        self.dropped_groups = 0
        self.trained = 0
        self.pushes = 0
        self.res = Result(mode, eta, 0.0, 0, 0.0, 0.0)

    # -- scheduling ---------------------------------------------------------------------------------------------
    def at(self, t: float, kind: str, payload=None) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, self.order, kind, payload))

    def admit_until(self, groups: int) -> None:
        """Admit groups up to (excluding) ``groups``; idle engines start on them."""
        B, G = self.w.prompts_per_step, self.w.group_size
        while self.next_group < min(groups, (self.w.steps * B) + self.dropped_groups):
            g = self.next_group
            self.next_group += 1
            self.left_in_group[g] = G
            self.tokens_in_group[g] = []
            self.queue += [_Seq(g, max(1, self.w.lengths(self.rng))) for _ in range(G)]
        self.fill()

    def fill(self) -> None:
        """Queued sequences to the least-loaded engines (the driver spreads requests evenly)."""
        while self.queue:
            e = min(range(self.c.engines), key=lambda i: len(self.active[i]))
            if len(self.active[e]) >= self.c.max_seqs:
                break
            self.active[e].append(self.queue.pop(0))
        for e in range(self.c.engines):
            if self.active[e] and not self.stepping[e]:
                self.start_step(e, max(self.now, self.paused_until))

    def start_step(self, e: int, t: float) -> None:
        self.stepping[e] = True
        cost = self.c.step_s + self.c.per_seq_s * len(self.active[e])
        self.res.engine_busy_s += cost
        self.at(t + cost, "step", e)

    # -- events -------------------------------------------------------------------------------------------------
    def on_step(self, e: int) -> None:
        still = []
        for s in self.active[e]:
            s.versions.append(self.version)
            s.left -= 1
            if s.left:
                still.append(s)
                continue
            self.tokens_in_group[s.group].append(s.versions)
            self.left_in_group[s.group] -= 1
            if not self.left_in_group[s.group]:
                self.complete.append(s.group)
        self.active[e] = still
        self.stepping[e] = False
        self.fill()
        if self.push_pending and self.batch_ready():
            self.push_pending = False
            self.push()
        self.maybe_train()

    def batch_ready(self) -> list[int] | None:
        B = self.w.prompts_per_step
        if self.mode == "async":
            self.drop_stale()
            return self.complete[:B] if len(self.complete) >= B else None
        want = set(range(self.trained * B, (self.trained + 1) * B))
        return sorted(want) if want <= set(self.complete) else None

    def drop_stale(self) -> None:
        """Groups with a token older than ``eta`` versions are refused (stale_policy drop) and replaced."""
        stale = [g for g in self.complete if min(min(v) for v in self.tokens_in_group[g]) < self.version - self.eta]
        for g in stale:
            self.complete.remove(g)
            del self.tokens_in_group[g]
            self.res.dropped += self.w.group_size
            self.dropped_groups += 1
        if stale:
            self.admit_until(self.admitted_bound())

    def admitted_bound(self) -> int:
        """Async admission: (version + eta + 1) batches of groups, plus one for each group dropped as stale."""
        return (self.version + self.eta + 1) * self.w.prompts_per_step + self.dropped_groups

    def maybe_train(self) -> None:
        if self.learner_busy or self.push_pending or self.trained >= self.w.steps:
            return
        batch = self.batch_ready()
        if batch is None:
            return
        for g in batch:
            self.complete.remove(g)
        tokens = [v for g in batch for seq in self.tokens_in_group.pop(g) for v in seq]
        self.res.staleness += [self.version - v for v in tokens]
        self.res.completions += len(batch) * self.w.group_size
        cost = self.c.train_s + self.c.per_token_s * len(tokens)
        self.learner_busy = True
        self.res.learner_busy_s += cost
        if self.mode == "one_step_off":  # the next batch is generated during this update
            self.admit_until((self.trained + 2) * self.w.prompts_per_step)
        self.at(self.now + cost, "trained")

    def on_trained(self) -> None:
        self.trained += 1
        if self.mode == "one_step_off" and self.trained < self.w.steps and not self.batch_ready():
            self.push_pending = True  # the engines finish the next batch before they reload
            return
        self.push()

    def push(self) -> None:
        if self.mode == "async":  # the sequences a push meets mid-generation go on after it (partial rollouts)
            self.res.partial += sum(len(a) for a in self.active)
        self.paused_until = self.now + self.c.push_s
        self.at(self.paused_until, "pushed")

    def on_pushed(self) -> None:
        self.version += 1
        self.pushes += 1
        self.learner_busy = False
        B = self.w.prompts_per_step
        if self.mode == "sync":
            self.admit_until((self.trained + 1) * B)
        elif self.mode == "async":
            self.admit_until(self.admitted_bound())
        self.fill()
        self.maybe_train()

    def run(self) -> Result:
        B = self.w.prompts_per_step
        first = {"sync": B, "one_step_off": B, "async": (self.eta + 1) * B}[self.mode]
        self.admit_until(first)
        while self.events and self.pushes < self.w.steps:  # a step ends with its push
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "step":
                self.on_step(payload)
            elif kind == "trained":
                self.on_trained()
            elif kind == "pushed":
                self.on_pushed()
        self.res.wall_s = self.now
        return self.res


def simulate(mode: str, costs: Costs, work: Workload, eta: int = 0, seed: int = 0) -> Result:
    if mode not in ("sync", "one_step_off", "async"):
        raise ValueError(f"mode {mode!r}; valid: sync, one_step_off, async")
    return _Sim(mode, eta, costs, work, seed).run()


def long_tail(short: int, cap: int, tail: float) -> Callable[[random.Random], int]:
    """Completion lengths like DAPO's: most near ``short`` (exponential), a ``tail`` fraction at the cap."""
    def draw(rng: random.Random) -> int:
        return cap if rng.random() < tail else min(cap, 1 + int(rng.expovariate(1 / short)))
    return draw


def table(costs: Costs, work: Workload, etas=(1, 2, 4), seed: int = 0) -> list[dict]:
    """One row per mode: completions/s, the speed-up over sync, idle ratios, staleness, partial and dropped."""
    runs = [simulate("sync", costs, work, seed=seed), simulate("one_step_off", costs, work, seed=seed)]
    runs += [simulate("async", costs, work, eta, seed) for eta in etas]
    base = runs[0].completions_per_s
    return [{"mode": r.mode + (f" eta={r.eta}" if r.mode == "async" else ""),
             "completions/s": round(r.completions_per_s, 2), "x sync": round(r.completions_per_s / base, 2),
             "engine idle": round(r.idle(costs)[0], 2), "learner idle": round(r.idle(costs)[1], 2),
             "staleness max": max(r.staleness, default=0), "partial": r.partial, "dropped": r.dropped}
            for r in runs]


ILLUSTRATIVE = (Costs(engines=1, max_seqs=64, step_s=0.02, per_seq_s=0.001, train_s=0.5, per_token_s=0.001,
                      push_s=0.2),
                Workload(prompts_per_step=8, group_size=8, lengths=long_tail(24, 128, 0.05), steps=30))
"""Costs of the order of the embedded model's on 2 cores (not calibrated): the model's behaviour, not a forecast."""


def main() -> None:
    costs, work = ILLUSTRATIVE
    print("async_sim: illustrative costs (not calibrated), one engine pool and one learner on their own hardware;"
          " lengths: exponential mean 24, 5% at the 128 cap")
    rows = table(costs, work)
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))


if __name__ == "__main__":
    main()
