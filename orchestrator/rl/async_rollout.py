"""``rollout.mode: async``: the engines generate without pause from the prompt stream, the reward actors
score groups as they complete, the learner takes a batch as soon as ``data.prompts_per_step`` groups are ready.

Two parts. :class:`Ledger` is the bookkeeping, pure (no Ray): which prompts of the stream are admitted, the
admission bound, which complete groups a batch takes, what is dropped, and the count that says nothing was lost::

    admitted <= (version + eta + 1) * B + dropped        (AReaL's capacity rule; B = prompts per step)
    submitted == trained + dropped + in flight            (checked at every batch)

A group whose oldest token is more than ``eta`` versions older than the learner is never trained:
``stale_policy: drop`` drops it (its slot goes back to the stream); ``wait`` makes the learner wait for every
group that would be too old after the coming push and train on it first. With ``eta = 0`` both admit one batch,
wait for all of it and push with nothing in flight: exactly ``sync``.

:class:`AsyncRollout` drives the streaming rollout actors (:mod:`workers.stream`) from the driver: it keeps the
engines' membership (a replaced or added engine starts streaming, a lost one's prompts are requeued from scratch),
admits prompts, polls finished samples, scores complete groups and hands batches to the RL loop
(:class:`orchestrator.loops.policy.PolicyLoop`). Weight pushes reach the streams through the ordinary push
(:meth:`workers.rollout.RolloutWorker.load_weights` lands between two engine steps).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.rl.collect import Sampling, check_reward_errors, reward_calls
from rewards.tasks import Prompt
from workers.records import Collected, Sample, ScoredSample

log = logging.getLogger("fleetrl")

STALL_S = 600.0
"""A batch that waits this long with no sample finishing on any engine ends the run (a hang made an error)."""


class StreamStalled(RuntimeError):
    """The engines stopped finishing samples while the learner waited for a batch."""


@dataclass
class Group:
    """One admitted prompt of the stream and its G samples as they finish."""

    index: int  # position in the prompt stream (never reused)
    prompt: Prompt
    seed: int  # the sampling seed of the stream batch it belongs to (sync's seed for that step)
    admitted_at: int  # policy version when it was (re)submitted: its tokens are no older
    worker: object = None  # key of the engine generating it; None: waiting to be submitted
    samples: list[Sample] = field(default_factory=list)
    scored: list[ScoredSample] | None = None
    done_seq: int = -1  # completion order

    @property
    def oldest(self) -> int:
        """The version of its oldest token (a bound from the admission while it is generating)."""
        if self.samples and self.scored is not None:
            return min(v for s in self.samples for v in (s.token_versions or [s.policy_version]))
        return self.admitted_at


class Ledger:
    """Admission, batch selection and the prompt accounting of the asynchronous mode (see the module)."""

    def __init__(self, batch_size: int, group_size: int, max_staleness: int, stale_policy: str,
                 prompt_at: Callable[[int], tuple[Prompt, int]]):
        """``prompt_at(n)``: the stream's ``n``-th prompt and its sampling seed."""
        self.B, self.G, self.eta, self.policy, self.prompt_at = batch_size, group_size, max_staleness, stale_policy, \
            prompt_at
        self.admitted = 0  # stream positions handed out (the next position)
        self.trained = 0
        self.dropped_stale = 0
        self.requeued = 0
        self.groups: dict[str, Group] = {}  # admitted, not trained or dropped
        self._done = itertools.count()

    @property
    def dropped(self) -> int:
        return self.dropped_stale

    def capacity(self, version: int) -> int:
        """How many more prompts may be admitted at ``version``."""
        return max(0, (version + self.eta + 1) * self.B + self.dropped - self.admitted)

    def admit(self, version: int) -> list[Group]:
        """New groups up to the capacity."""
        out = []
        for _ in range(self.capacity(version)):
            prompt, seed = self.prompt_at(self.admitted)
            g = Group(self.admitted, prompt, seed, version)
            self.groups[prompt.uid] = g
            self.admitted += 1
            out.append(g)
        return out

    def unsubmitted(self) -> list[Group]:
        return sorted((g for g in self.groups.values() if g.worker is None), key=lambda g: g.index)

    def requeue(self, worker, version: int) -> int:
        """``worker`` is gone: its unfinished groups start again from scratch (same prompt, seed and uid)."""
        lost = [g for g in self.groups.values() if g.worker == worker and g.scored is None]
        for g in lost:
            g.worker, g.samples, g.admitted_at = None, [], version
        self.requeued += len(lost)
        return len(lost)

    def add(self, sample: Sample) -> Group | None:
        """A finished sample; its group when that is now complete (to be scored)."""
        g = self.groups.get(sample.prompt_uid)
        if g is None or g.scored is not None or len(g.samples) >= self.G:
            return None
        g.samples.append(sample)
        return g if len(g.samples) == self.G else None

    def scored(self, g: Group, scored: list[ScoredSample]) -> None:
        g.scored, g.done_seq = scored, next(self._done)

    def select(self, version: int) -> tuple[list[Group] | None, list[Group]]:
        """The batch the learner at ``version`` trains on (None: not ready yet), and the groups dropped now.
        ``drop``: the complete groups, oldest token first; a group with a token older than ``eta`` versions is
        dropped. ``wait``: the ``B`` groups admitted first, once all are complete (the learner waits for them): the
        admission bound then keeps every token within ``eta`` versions and nothing is dropped."""
        dropped = [g for g in self.groups.values() if g.scored is not None and version - g.oldest > self.eta]
        for g in dropped:
            del self.groups[g.prompt.uid]
        self.dropped_stale += len(dropped)
        if self.policy == "wait":  # admission order: a group admitted at version a is trained by a + eta
            ready = sorted(self.groups.values(), key=lambda g: g.index)[: self.B]
            if any(g.scored is None for g in ready):
                return None, dropped
        else:
            ready = sorted((g for g in self.groups.values() if g.scored is not None),
                           key=lambda g: (g.oldest, g.done_seq))
        if len(ready) < self.B:
            return None, dropped
        batch = sorted(ready[: self.B], key=lambda g: g.index)
        for g in batch:
            del self.groups[g.prompt.uid]
        self.trained += len(batch)
        self.check()
        return batch, dropped

    def check(self) -> None:
        """Nothing lost: every admitted prompt is trained, dropped or still in flight."""
        if self.admitted != self.trained + self.dropped + len(self.groups):
            raise RuntimeError(f"async accounting broken: {self.admitted} prompts submitted != {self.trained} trained"
                               f" + {self.dropped} dropped + {len(self.groups)} in flight")

    def metrics(self) -> dict:
        return {"async/submitted": self.admitted, "async/trained": self.trained, "async/dropped_stale":
                self.dropped_stale, "async/in_flight": len(self.groups), "async/requeued": self.requeued}

    def state(self) -> dict:
        """What a checkpoint records: the stream position, the counts, and the prompts in flight (re-issued from
        scratch on resume; their positions are never handed out again)."""
        return {"admitted": self.admitted, "trained": self.trained, "dropped_stale": self.dropped_stale,
                "requeued": self.requeued, "in_flight": sorted(g.index for g in self.groups.values())}

    def start_at(self, step: int) -> None:
        """A run resumed at ``step`` from a checkpoint of another mode (no stream recorded): the stream goes on from
        that step's prompts, as sync would."""
        self.admitted = self.trained = step * self.B

    def restore(self, state: dict, version: int) -> None:
        self.admitted, self.trained = state["admitted"], state["trained"]
        self.dropped_stale, self.requeued = state["dropped_stale"], state["requeued"]
        for n in state["in_flight"]:
            prompt, seed = self.prompt_at(n)
            self.groups[prompt.uid] = Group(n, prompt, seed, version)
        self.check()


def batch_metrics(groups: list[Group], version: int) -> dict:
    """How old the trained tokens are (mean over tokens, max), and the share of samples that span a push."""
    ages, partial, n = [], 0, 0
    for g in groups:
        for s in g.samples:
            versions = s.token_versions or [s.policy_version] * len(s.completion_ids)
            ages += [version - v for v in versions]
            partial += len(set(versions)) > 1
            n += 1
    return {"async/staleness_mean": sum(ages) / max(1, len(ages)), "async/staleness_max": max(ages, default=0),
            "async/partial_frac": partial / max(1, n)}


def balanced_counts(loads: list[int], n: int) -> list[int]:
    """How many of ``n`` new prompts each engine gets so the loads even out (ties to the first engines)."""
    counts = [0] * len(loads)
    for _ in range(n):
        i = min(range(len(loads)), key=lambda k: (loads[k] + counts[k], k))
        counts[i] += 1
    return counts


class AsyncRollout:
    """The driver's side of the asynchronous mode (see the module): one per run, started at its first batch."""

    def __init__(self, run: Sampling):
        cfg = run.cfg
        self.run, self.cfg = run, cfg
        B = cfg.data.prompts_per_step
        self._batches: dict[int, list[Prompt]] = {}
        self.ledger = Ledger(B, cfg.rollout.group_size, cfg.rollout.max_staleness, cfg.rollout.stale_policy,
                             self._prompt_at)
        self.streaming: dict[object, object] = {}  # engine key -> its actor handle, for engines that stream
        self.idle_s: dict[object, float] = {}
        self.errors, self.calls, self.judge_errors = 0, 0, 0
        self.first_error: str | None = None
        self.timeouts = run.fleet.rewards.timeouts
        self.t_mark, self.idle_mark = time.perf_counter(), 0.0

    def _prompt_at(self, n: int) -> tuple[Prompt, int]:
        """The stream's ``n``-th prompt: sync's step ``n // B`` prompts in order, with that step's seed."""
        B = self.cfg.data.prompts_per_step
        k = n // B
        if k not in self._batches:
            self._batches = {k: self.run.task.train_batch(k, B)}
        return self._batches[k][n % B], self.cfg.rollout.seed * 100_003 + k

    # ---- the loop's calls --------------------------------------------------------------------------------------

    def take(self, step: int) -> Collected:
        """The next batch: admit, poll and score until ``prompts_per_step`` groups are ready for the learner."""

        t0 = progress = time.perf_counter()
        while True:
            if self.pump():
                progress = time.perf_counter()
            batch, _ = self.ledger.select(self.run.version)
            if batch is not None:
                break
            if time.perf_counter() - progress > STALL_S:
                raise StreamStalled(f"step {step}: no sample finished for {STALL_S:.0f} s with "
                                    f"{len(self.ledger.groups)} prompts in flight on {len(self.streaming)} engines "
                                    f"(rollout.mode=async); the engines' logs are in {self.run.run_dir / 'logs'}/")
            time.sleep(0.01)
        out = Collected([x for g in batch for x in sorted(g.scored, key=lambda x: x.sample.sample_index)],
                        self.errors, self._info(batch, time.perf_counter() - t0), self.first_error)
        self.errors, self.calls, self.judge_errors, self.first_error = 0, 0, 0, None
        check_reward_errors(self.run, step, out)
        return out

    def pump(self) -> bool:
        """One round of the driver's side: engines joined or lost, prompts admitted, finished samples taken,
        complete groups scored. Whether any sample finished."""
        self._membership()
        self._submit()
        finished, complete = self._poll()
        if complete:
            self._score(complete)
        return finished

    def close(self) -> None:
        """Every engine back to call-by-call generation; its unfinished samples are dropped with the run."""
        import ray

        from orchestrator.telemetry.console import error_summary

        for i, w in enumerate(self.run.fleet.rollouts.workers):  # every engine (a no-op on one not streaming)
            try:
                ray.get(w.stream_stop.remote())
            except ray.exceptions.RayActorError:  # a dead engine streams nothing
                pass
            except ray.exceptions.RayError as e:  # its stream had failed: the run is over, say so and go on
                log.warning("stopping the stream of rollout engine %d: %s", i, error_summary(e))
        self.streaming.clear()

    # ---- the parts --------------------------------------------------------------------------------------------

    def _membership(self) -> None:
        """A replaced, added or removed engine (a fault, `fleetrl scale`): new ones start streaming, a lost one's
        groups are requeued."""
        r = self.cfg.rollout
        current = {w._actor_id: w for w in self.run.fleet.rollouts.workers}
        for key in [k for k in self.streaming if k not in current]:
            del self.streaming[key]
            self.idle_s.pop(key, None)
            self.ledger.requeue(key, self.run.version)
        new = {k: w for k, w in current.items() if k not in self.streaming}
        started = self._each({k: w.stream_start.remote(r.temperature, r.top_p) for k, w in new.items()})
        self.streaming.update({k: new[k] for k in started})

    def _submit(self) -> None:
        self.ledger.admit(self.run.version)
        waiting = self.ledger.unsubmitted()
        if not waiting or not self.streaming:
            return
        keys = list(self.streaming)
        loads = [sum(g.worker == k and g.scored is None for g in self.ledger.groups.values()) for k in keys]
        calls, start = {}, 0
        for key, count in zip(keys, balanced_counts(loads, len(waiting))):
            part = waiting[start: start + count]
            start += count
            if not part:
                continue
            for g in part:
                g.worker, g.admitted_at = key, self.run.version
            calls[key] = self.streaming[key].stream_submit.remote(
                [(g.prompt.uid, g.prompt.text, g.prompt.metadata) for g in part], self.cfg.rollout.group_size,
                self.cfg.rollout.max_new_tokens, [g.seed for g in part])
        self._each(calls)

    def _poll(self) -> tuple[bool, list[Group]]:
        """Finished samples from every engine: whether there were any, and the groups they complete."""
        finished, complete = False, []
        for key, took in self._each({k: w.stream_take.remote() for k, w in self.streaming.items()}).items():
            self.idle_s[key] = took.idle_s
            finished = finished or bool(took.samples)
            complete += [g for g in map(self.ledger.add, took.samples) if g is not None]
        return finished, complete

    def _each(self, calls: dict) -> dict:
        """Each engine's answer to its call (engine key -> ObjectRef). An engine that died is replaced by its pool
        (restart budget ``rollout.max_restarts``) and has no answer: its groups are requeued by the next
        :meth:`_membership`, which starts the replacement's stream."""
        import ray

        from orchestrator.telemetry.console import actor_failed

        pool, out = self.run.fleet.rollouts, {}
        for key, ref in calls.items():
            index = next((i for i, w in enumerate(pool.workers) if w._actor_id == key), None)
            try:
                out[key] = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if index is not None:
                    pool.restart(index, e)
            except ray.exceptions.RayTaskError as e:
                raise actor_failed(pool.workers[index] if index is not None else "a rollout actor", e) from e
        return out

    def _score(self, groups: list[Group]) -> None:
        rewards = self.run.fleet.rewards
        samples = [s for g in groups for s in sorted(g.samples, key=lambda s: s.sample_index)]
        scored, errors, judge_errors = rewards.score_judged(samples, [g.prompt for g in groups])
        G = self.cfg.rollout.group_size
        for k, g in enumerate(groups):
            self.ledger.scored(g, scored[k * G: (k + 1) * G])
        self.errors += errors
        self.judge_errors += judge_errors
        self.calls += reward_calls(self.cfg, len(samples))
        if errors and self.first_error is None:
            self.first_error = rewards.first_error

    def _info(self, batch: list[Group], waited: float) -> dict:
        """The batch's sampling metrics (as :func:`orchestrator.rl.collect.collect` gives them) and ``async/*``."""
        now, idle = time.perf_counter(), sum(self.idle_s.values())
        engines = max(1, len(self.streaming))
        engine_idle = (idle - self.idle_mark) / max(1e-9, (now - self.t_mark) * engines)
        self.t_mark, self.idle_mark = now, idle
        timed_out = self.run.fleet.rewards.timeouts - self.timeouts
        self.timeouts = self.run.fleet.rewards.timeouts
        return {"reward/error_frac": (self.errors + timed_out) / max(1, self.calls), "reward/timeouts": timed_out,
                **({"reward/judge_errors": self.judge_errors} if self.run.judge else {}),
                **self.ledger.metrics(), **batch_metrics(batch, self.run.version),
                "async/waited_s": waited, "async/engine_idle_frac": min(1.0, max(0.0, engine_idle))}
