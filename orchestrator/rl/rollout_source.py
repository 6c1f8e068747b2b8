"""Where a sampling loop's batches come from: one :class:`RolloutSource` per run, chosen once from ``rollout.mode``
(or a user's class, ``rollout.source``) through :data:`SOURCES`, and handed by the run to every loop that samples
(RL and on-policy distillation, online DPO, RFT)::

    collected = run.source.take(step, timer)      # the step's scored groups
    ... the loop's update, while run.source.pump() keeps the engines fed ...
    run.sync_weights(timer)                       # run.source.settle(), then the push

``sync``: generated when taken. ``one_step_off``: the next step's batch is generated and scored while this step
trains (with the weights before its update). ``async``: the engines stream without pause
(:class:`orchestrator.rl.async_rollout.AsyncSource`). What a source has in flight is its state in a checkpoint
(:meth:`RolloutSource.save`, :meth:`RolloutSource.restore`). A new mode is one class and one line in
:data:`SOURCES`; whether a loop's objective may train on older policies' samples is the algorithm's
(``accepts_stale_samples``), checked with the config.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from orchestrator.rl import checkpoint as ckpt
from orchestrator.rl.async_rollout import AsyncRollout
from orchestrator.rl.collect import Sampling, collect
from orchestrator.telemetry.metrics import PhaseTimer
from workers.records import Collected

if TYPE_CHECKING:
    from orchestrator.config import FleetConfig


class RolloutSource:
    """What a sampling loop takes its batches from (see the module). The base keeps one batch that a checkpoint
    holds in flight (``pending``): the next :meth:`take` returns it first."""

    overlaps_learner: ClassVar[bool] = False
    """The engines generate while the learner trains (each CPU engine then gets one torch thread)."""

    def __init__(self, run: Sampling):
        self.run = run
        self.pending: Collected | None = None

    def take(self, step: int, timer: PhaseTimer) -> Collected:
        """``step``'s scored groups."""
        raise NotImplementedError

    def pump(self) -> Callable[[], object] | None:
        """What to call repeatedly while the learner works (None: nothing to do meanwhile)."""
        return None

    def settle(self) -> int:
        """Before a push: what is being generated with the current weights is finished first. Returns how many
        prompts wait for the next step (``rollout/queue_depth``)."""
        return 0

    def in_flight(self) -> Collected | None:
        """A batch generated for the next step and not trained on yet (saved with a checkpoint)."""
        return self.pending

    def save(self, stage: Path) -> None:
        """Write what the source has in flight into the checkpoint being staged at ``stage``."""
        batch = self.in_flight()
        if batch is not None:
            ckpt.save_in_flight(stage, batch)

    def restore(self, path: Path) -> None:
        """Take up what the checkpoint at ``path`` had in flight (a one_step_off batch is trained on next)."""
        self.pending = ckpt.load_in_flight(path)

    def busy_s(self, phases: dict, learner_s: float) -> float:
        """Of a step's time, the seconds the engines or the learner worked (``time/overhead_s`` is the rest)."""
        return phases.get("time/generate_s", 0.0) + learner_s

    def metrics(self, phases: dict) -> dict:
        """The source's own per-step metrics."""
        return {}

    def close(self) -> None:
        """The run ends: release what the source holds on the fleet."""


class SyncSource(RolloutSource):
    """``rollout.mode: sync``: the step's groups are generated and scored when taken, with the current weights."""

    def take(self, step: int, timer: PhaseTimer) -> Collected:
        if self.pending is not None:
            out, self.pending = self.pending, None
            return out
        return collect(self.run, step, timer)


@dataclasses.dataclass
class InFlight:
    """one_step_off: the next step's batch, generated and scored while this step trains, and its phase times."""

    batch: Collected
    timer: PhaseTimer


class OneStepOffSource(RolloutSource):
    """``rollout.mode: one_step_off``: the batch of step ``s + 1`` is generated and scored (with the weights before
    step ``s``'s update) while step ``s`` trains; :meth:`settle` waits for it before the push."""

    overlaps_learner = True

    def __init__(self, run: Sampling):
        super().__init__(run)
        self.prefetch: Future[InFlight] | None = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")

    def take(self, step: int, timer: PhaseTimer) -> Collected:
        if self.pending is not None:
            out, self.pending = self.pending, None
        elif self.prefetch is None:
            out = collect(self.run, step, timer)
        else:
            done, self.prefetch = self.prefetch.result(), None
            out = done.batch
            for phase, seconds in done.timer.seconds.items():
                timer.seconds[f"{phase}_overlapped"] = seconds
        if step + 1 < self.run.cfg.trainer.total_steps:
            self.prefetch = self.pool.submit(self._collect_timed, step + 1)
        return out

    def _collect_timed(self, step: int) -> InFlight:
        timer = PhaseTimer()
        return InFlight(collect(self.run, step, timer), timer)

    def settle(self) -> int:
        if self.prefetch is None:
            return 0
        return len({x.sample.prompt_uid for x in self.prefetch.result().batch.scored})

    def in_flight(self) -> Collected | None:
        return self.prefetch.result().batch if self.prefetch is not None else self.pending

    def busy_s(self, phases: dict, learner_s: float) -> float:
        """Generation and the learner overlap: the longer of the two counts."""
        gen = phases.get("time/generate_s", 0.0) + phases.get("time/generate_overlapped_s", 0.0)
        return max(gen, learner_s + phases.get("time/rollout_wait_s", 0.0))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class AsyncSource(RolloutSource):
    """``rollout.mode: async``: the engines stream (:class:`orchestrator.rl.async_rollout.AsyncRollout`, started at
    the first batch); a batch is the next ``data.prompts_per_step`` complete groups, and the learner's waits pump
    the stream. Its state is the ledger (the stream's position, the prompts in flight)."""

    overlaps_learner = True

    def __init__(self, run: Sampling):
        super().__init__(run)
        self.stream = AsyncRollout(run)

    def take(self, step: int, timer: PhaseTimer) -> Collected:
        with timer("rollout_wait"):
            return self.stream.take(step)

    def pump(self) -> Callable[[], object] | None:
        return self.stream.pump

    def in_flight(self) -> Collected | None:
        return None

    def save(self, stage: Path) -> None:
        (stage / STREAM_STATE).write_text(json.dumps({"stream": self.stream.ledger.state()}))

    def restore(self, path: Path) -> None:
        """The checkpoint's stream, or (one of another mode) the stream going on from its step's prompts."""
        if (path / STREAM_STATE).exists():
            self.stream.ledger.restore(json.loads((path / STREAM_STATE).read_text())["stream"], self.run.version)
        else:
            self.stream.ledger.start_at(self.run.start_step)

    def settle(self) -> int:
        return self.stream.ledger.metrics()["async/in_flight"]

    def busy_s(self, phases: dict, learner_s: float) -> float:
        """The engines never stop: the learner's side is the step."""
        return learner_s + phases.get("time/rollout_wait_s", 0.0)

    def metrics(self, phases: dict) -> dict:
        return {"async/learner_idle_frac": phases.get("time/rollout_wait_s", 0.0) / phases["time/step_s"]}

    def close(self) -> None:
        self.stream.close()


STREAM_STATE = "loop_state.json"
"""In a checkpoint of an async run: the stream's ledger."""

SOURCES: dict[str, type[RolloutSource]] = {"sync": SyncSource, "one_step_off": OneStepOffSource,
                                           "async": AsyncSource}
"""``rollout.mode`` -> its source."""


def source_class(cfg: FleetConfig) -> type[RolloutSource]:
    """The run's source: ``rollout.source`` (a user's :class:`RolloutSource`, ``module:Class``) or the one of
    ``rollout.mode``."""
    return import_source(cfg.rollout.source) if cfg.rollout.source else SOURCES[cfg.rollout.mode]


def import_source(path: str) -> type[RolloutSource]:
    """``module:Class``, a :class:`RolloutSource` subclass; a ValueError naming what is wrong otherwise."""
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"rollout.source={path!r}: cannot import it ({e}); write it as module:Class") from None
    if not (isinstance(cls, type) and issubclass(cls, RolloutSource)):
        raise ValueError(f"rollout.source={path!r} is not a subclass of orchestrator.rl.rollout_source.RolloutSource")
    return cls
