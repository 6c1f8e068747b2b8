"""Partial rollouts: generation that a weight push interrupts without losing or regenerating a token.

A :class:`Stream` drives one vLLM ``LLMEngine`` (``llm.llm_engine``) a step at a time. Requests are added at any
time (:meth:`Stream.submit`); every step's new tokens are recorded with their logprobs and the policy version that
sampled them. A weight push (:meth:`Stream.push`) happens between two steps: the unfinished requests are aborted,
the new weights loaded, and each request is resubmitted with what it generated so far appended to its prompt and
what remains of its token budget. A sample that spans a push keeps its earlier tokens with their behaviour
logprobs and versions; its later tokens are sampled by the new weights (AReaL and verl's fully asynchronous mode
do the same: abort, then resubmit with the prefix, whose KV cache the engine recomputes with the new weights).

The engine is not thread-safe: one thread calls ``submit``, ``step`` and ``push``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Partial:
    """One sample as far as it got: its tokens, their behaviour logprobs and the version that sampled each."""

    uid: str
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    resubmits: int = 0

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.token_ids)

    @property
    def request_id(self) -> str:
        return f"{self.uid}#{self.resubmits}"  # an aborted request's id is never reused


class Stream:
    def __init__(self, engine, params_for: Callable, version: int = 0, lora: Callable[[], object] | None = None):
        """``engine``: a vLLM ``LLMEngine``; ``params_for(max_new_tokens, seed)`` -> the request's
        ``SamplingParams`` (with ``logprobs=0``); ``version``: the policy version of the engine's weights;
        ``lora()``: the served adapter's ``LoRARequest`` at the time a request is (re)submitted."""
        self.engine, self.params_for, self.version, self.lora = engine, params_for, version, lora
        self.live: dict[str, Partial] = {}  # request id -> the sample it continues

    def submit(self, uid: str, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None) -> None:
        self._add(Partial(uid, list(prompt_ids), max_new_tokens, seed))

    def _add(self, p: Partial) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        seed = p.seed  # a first submission samples as RolloutWorker.generate does; a resubmission draws afresh
        if seed is not None and p.resubmits:
            seed = (seed * 1_000_003 + p.resubmits) % (2**31 - 1)
        params = self.params_for(p.remaining, seed)
        params.output_kind = RequestOutputKind.DELTA  # each step's new tokens, stamped with the version now
        self.live[p.request_id] = p
        self.engine.add_request(p.request_id, TokensPrompt(prompt_token_ids=p.prompt_ids + p.token_ids), params,
                                lora_request=self.lora() if self.lora else None)

    @property
    def in_flight(self) -> int:
        return len(self.live)

    def step(self) -> list[Partial]:
        """One engine step: the new tokens recorded; the samples that finished in it."""
        done = []
        for out in self.engine.step():
            p = self.live.get(out.request_id)
            if p is None:
                continue
            comp = out.outputs[0]
            new = list(comp.token_ids)
            p.token_ids += new
            p.logprobs += [lp[t].logprob for lp, t in zip(comp.logprobs or [], new)]
            p.versions += [self.version] * len(new)
            if out.finished:
                p.finish_reason = comp.finish_reason or "length"
                done.append(self.live.pop(out.request_id))
        return done

    def abort_all(self) -> int:
        """Drop every unfinished request; how many there were."""
        self.engine.abort_request(list(self.live))
        n = len(self.live)
        self.live.clear()
        return n

    def paused(self, fn: Callable[[], object]):
        """``fn()`` between two steps with the engine to itself: the unfinished requests aborted first and each
        resubmitted afterwards with its tokens so far and the rest of its budget, also when ``fn`` raises (a
        weight push's load, or a call that generates on the engine: an eval, the weight-sync probe)."""
        paused = list(self.live.values())
        self.abort_all()
        try:
            return fn()
        finally:
            for p in paused:
                p.resubmits += 1
                self._add(p)

    def push(self, load: Callable[[], object], version: int) -> dict:
        """A weight push between two steps (:meth:`paused`): ``load()`` the new weights, and the resubmitted
        requests sample with them as ``version``. When ``load`` raises the engine still serves the old weights
        and version. ``loaded``: what ``load`` returned."""
        t0 = time.perf_counter()
        resubmitted = len(self.live)

        def load_as_version():
            out = load()
            self.version = version
            return out

        loaded = self.paused(load_as_version)
        return {"resubmitted": resubmitted, "seconds": time.perf_counter() - t0, "version": self.version,
                "loaded": loaded}


class StreamService:
    """A :class:`Stream` stepped on a thread of its own, so the engine generates between (and during) the actor's
    method calls. Calls reach the engine through a queue and run on that thread between two steps (the engine is
    not thread-safe); :meth:`call` waits for one with a timeout, so a push that cannot get through ends with an
    error naming it instead of a hang. ``on_done(partial)`` turns a finished sample into what :meth:`take` returns."""

    def __init__(self, stream: Stream, on_done: Callable[[Partial], object]):
        import queue
        import threading

        self.stream, self.on_done = stream, on_done
        self.commands: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.finished: list = []
        self.error: BaseException | None = None
        self.closed = False
        self._idle_s = 0.0  # seconds the engine waited with nothing to generate, up to _idle_since
        self._idle_since: float | None = None  # when the current wait began (None: generating)
        # the engine's torch threads as set on the thread that built it: OpenMP's count is per thread, and a new
        # thread starts from OMP_NUM_THREADS, which an engine rebuilt with other threads no longer matches (vLLM's
        # CPU attention checks its metadata's count against the running thread's: RolloutWorker.rebuild)
        self.threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self._run, name="fleetrl-stream", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], object], what: str, timeout: float = 300.0):
        """``fn()`` on the engine's thread between two steps; its result (or its exception)."""
        from concurrent.futures import Future
        from concurrent.futures import TimeoutError as FutureTimeout

        if self.error is not None:
            raise RuntimeError(f"the generation stream stopped: {self.error!r}")
        future: Future = Future()
        self.commands.put((fn, future))
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(min(1.0, max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                if not self.thread.is_alive():  # it ended after this call was queued: answered, not waited out
                    self._fail_queued()
                elif time.monotonic() >= deadline:
                    raise TimeoutError(f"{what}: the generation stream did not take it within {timeout:.0f} s") \
                        from None

    @property
    def idle_s(self) -> float:
        """Seconds the engine has waited with nothing to generate since the stream started (an idle ratio's
        numerator), the current wait included."""
        with self.lock:
            since, total = self._idle_since, self._idle_s
        return total + (time.perf_counter() - since if since is not None else 0.0)

    def take(self) -> list:
        """The samples finished since the last call."""
        with self.lock:
            out, self.finished = self.finished, []
        if self.error is not None:
            raise RuntimeError(f"the generation stream stopped: {self.error!r}")
        return out

    def close(self) -> None:
        self.closed = True
        self.commands.put(None)
        self.thread.join(timeout=60)

    def _run(self) -> None:
        import queue

        torch._C.set_num_threads(self.threads)  # torch's own setter: vLLM's CPU worker replaces set_num_threads
        try:
            while not self.closed:
                idle = not self.stream.in_flight
                with self.lock:  # the idle clock's two fields change together (idle_s reads them from another thread)
                    if idle and self._idle_since is None:
                        self._idle_since = time.perf_counter()
                    elif not idle and self._idle_since is not None:
                        self._idle_s += time.perf_counter() - self._idle_since
                        self._idle_since = None
                try:  # idle: wait for a command; generating: only take what is already queued
                    item = self.commands.get(block=idle, timeout=1.0)
                except queue.Empty:
                    item = False
                if item is None:
                    break
                if item:
                    fn, future = item
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        future.set_exception(e)
                    continue  # every queued command before the next step
                if self.stream.in_flight:
                    done = [self.on_done(p) for p in self.stream.step()]
                    with self.lock:
                        self.finished += done
        except BaseException as e:  # noqa: BLE001 - reported by the next call or take
            self.error = e
        finally:  # a call queued while the thread ended gets an answer instead of waiting out its timeout
            self._fail_queued()

    def _fail_queued(self) -> None:
        import queue

        why = RuntimeError(f"the generation stream stopped: {self.error!r}" if self.error is not None
                           else "the generation stream was closed")
        while True:
            try:
                item = self.commands.get_nowait()
            except queue.Empty:
                return
            if item:
                item[1].set_exception(why)
