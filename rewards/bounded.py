"""Bounded calls: reward and verifier functions run in a few worker processes with a hard limit in time and memory.

A Python thread cannot be stopped: a completion such as ``\\boxed{10^{10^{10}}}`` keeps math-verify computing for
minutes, and a thread given up on by its caller keeps its core and its pool slot. So every correctness decision
(the ``math`` reward, ``train/accuracy``, evals, RFT, distillation, PRM labels, search) and every reward-function
call in the reward actors runs here: a call past ``timeout_s`` is abandoned by killing its worker process, which is
replaced; a worker's address space is capped at ``memory_mb`` (a call that exceeds it raises ``MemoryError``
there). A call past a limit is an :class:`Outcome` with ``status`` ``"timeout"`` (or ``"error"``), never a hang.

Protocol: each worker is ``python -m rewards.bounded``, reading pickled ``(functions, [(index, fn_index, args)])``
chunks on stdin and writing a pickled ``[(index, status, value)]`` on stdout as each call ends, so the first
unanswered call is the one running (the functions' own prints go to stderr). Frames are length-prefixed.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger("fleetrl.bounded")

DEFAULT_TIMEOUT_S = 5.0
"""The driver's limit per correctness decision: a normal one takes milliseconds (BENCHMARKS.md, verify)."""
DEFAULT_MEMORY_MB = 2048
START_TIMEOUT_S = 120.0
"""How long a new worker may take to import math-verify and say it is ready (a loaded 2-core machine)."""
CHUNK = 32
"""Calls sent to a worker at a time (one pipe round trip per chunk, not per call)."""
SLOW_S = 0.5
"""A call running longer than this hands the rest of its worker's chunk back to the queue, and the pool may start
one more worker (up to ``max_workers``), so slow calls run side by side instead of one after another."""
PREVIEW_CHARS = 200


@dataclass(frozen=True)
class Outcome:
    """One call's result: ``status`` is ``ok`` (``value`` is what the function returned), ``error`` (``value`` is
    the error's text) or ``timeout``."""

    status: str
    value: object = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _Worker:
    """One worker process and what it is doing: the calls sent and not answered, the current call's deadline."""

    def __init__(self, memory_mb: int):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                   FLEETRL_BOUNDED_MEMORY_MB=str(memory_mb))
        self.proc = subprocess.Popen([sys.executable, "-m", "rewards.bounded"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0)
        self.fd = self.proc.stdout.fileno()
        self.buffer = b""
        self.ready = False
        self.pending: list[int] = []  # call indices sent, in order, not yet answered
        self.deadline = time.monotonic() + START_TIMEOUT_S
        self.started = 0.0  # when the current call began
        self.shared = False  # its later calls were handed to other workers

    @property
    def idle(self) -> bool:
        return self.ready and not self.pending

    def send(self, fns: tuple, calls: list[tuple], timeout_s: float) -> None:
        data = pickle.dumps((fns, calls))
        self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
        self.pending = [c[0] for c in calls]
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s

    def frames(self) -> list:
        """The complete frames readable now; ``EOFError`` when the process closed its end (it died)."""
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            raise EOFError
        self.buffer += chunk
        out = []
        while len(self.buffer) >= 8:
            (size,) = struct.unpack("<Q", self.buffer[:8])
            if len(self.buffer) < 8 + size:
                break
            out.append(pickle.loads(self.buffer[8:8 + size]))
            self.buffer = self.buffer[8 + size:]
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class BoundedPool:
    """``workers`` processes running function calls under a hard time and memory limit (module docstring).
    Thread-safe (one batch at a time); :meth:`close` kills every worker."""

    def __init__(self, workers: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S, memory_mb: int = DEFAULT_MEMORY_MB,
                 max_workers: int = 8):
        self.n, self.timeout_s, self.memory_mb = workers, timeout_s, memory_mb
        self.max_workers = max(workers, max_workers)
        self.workers: list[_Worker] = []
        # workers die with the thread that started them (PR_SET_PDEATHSIG): one long-lived thread starts them all
        self._spawner: ThreadPoolExecutor | None = None
        self.timeouts = 0
        self.calls = 0
        self._lock = threading.Lock()

    def _new_worker(self) -> _Worker:
        if self._spawner is None:
            self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bounded-spawn")
        return self._spawner.submit(_Worker, self.memory_mb).result()

    def map(self, fns: Sequence[Callable], calls: Sequence[tuple[int, tuple]],
            describe: Callable[[tuple], str] | None = None) -> list[Outcome]:
        """Run ``fns[i](*args)`` for every ``(i, args)`` in ``calls``; one :class:`Outcome` per call, in order.
        ``describe(args)`` names a call in the log line of its timeout (default: its second argument, the
        completion)."""
        with self._lock:
            self._ensure_workers()
            return self._run(tuple(fns), list(calls), describe or _completion_of)

    def _ensure_workers(self) -> None:
        self.workers = [w for w in self.workers if w.proc.poll() is None]
        self.workers += [self._new_worker() for _ in range(self.n - len(self.workers))]

    def _run(self, fns: tuple, calls: list, describe: Callable) -> list[Outcome]:
        batch = _Batch(fns, calls, describe)
        while batch.open:
            for w in self.workers:
                chunk = batch.take(CHUNK) if w.idle else []
                if chunk:
                    w.send(fns, chunk, self.timeout_s)
            self._wait(batch)
            self._unblock(batch)
        for w in self.workers:  # still holding calls answered elsewhere: its pipe is stale
            if w.pending:
                self._replace(w, batch, None)
        self._shrink()
        self.calls += len(calls)
        return batch.results  # type: ignore[return-value]

    def _unblock(self, batch: _Batch) -> None:
        """A worker slow on one call hands its later calls to the others (it still runs them: the first answer
        counts); with calls waiting, a worker stuck and none free or starting, one more starts (up to
        ``max_workers``)."""
        now = time.monotonic()
        stuck = [w for w in self.workers if w.pending and now - w.started > SLOW_S]
        for w in stuck:
            if not w.shared and len(w.pending) > 1:
                batch.requeue(w.pending[1:])
                w.shared = True
        if batch.queue and stuck and not any(w.idle or not w.ready for w in self.workers) \
                and len(self.workers) < self.max_workers:
            self.workers.append(self._new_worker())

    def _shrink(self) -> None:
        while len(self.workers) > self.n:
            extra = next((w for w in self.workers if w.idle or not w.ready), self.workers[-1])
            extra.kill()
            self.workers.remove(extra)

    def _wait(self, batch: _Batch) -> None:
        """Read what the workers answered within the nearest deadline; replace a worker past its deadline (its
        current call times out; the calls it had not begun go back to the queue) or dead."""
        busy = [w for w in self.workers if w.pending or not w.ready]
        wait = max(0.0, min(w.deadline for w in busy) - time.monotonic()) if busy else 0.0
        readable, _, _ = select.select([w.fd for w in busy], [], [], wait)
        for w in list(self.workers):
            try:
                frames = w.frames() if w.fd in readable else []
            except EOFError:
                self._replace(w, batch, Outcome("error", f"the worker process died (exit code {w.proc.poll()})"))
                continue
            for frame in frames:
                if frame == "ready":
                    w.ready = True
                    continue
                for index, status, value in frame:
                    batch.resolve(index, Outcome(status, value))
                    w.pending.remove(index)
                w.started = time.monotonic()
                w.deadline = w.started + self.timeout_s
            if (w.pending or not w.ready) and time.monotonic() > w.deadline:
                self._replace(w, batch, Outcome("timeout"))

    def _replace(self, w: _Worker, batch: _Batch, outcome: Outcome | None) -> None:
        """Kill ``w`` and start another; its running call gets ``outcome``, its later calls go back to the queue."""
        w.kill()
        self.workers[self.workers.index(w)] = self._new_worker()
        if not w.ready:
            log.error("a bounded worker did not start within %.0f s (exit code %s)", START_TIMEOUT_S,
                      w.proc.returncode)
        if outcome is None or not w.pending:
            return
        if batch.resolve(w.pending[0], outcome) and outcome.status == "timeout":
            self.timeouts += 1
            log.warning("a call ran past %.1f s and was stopped (scored as wrong): %r", self.timeout_s,
                        batch.describe(batch.calls[w.pending[0]][1])[:PREVIEW_CHARS])
        if not w.shared:
            batch.requeue(w.pending[1:])

    def close(self) -> None:
        with self._lock:
            for w in self.workers:
                w.kill()
            self.workers = []
            if self._spawner is not None:
                self._spawner.shutdown()
                self._spawner = None


class _Batch:
    """One :meth:`BoundedPool.map`: the calls, their outcomes so far (the first answer of a call counts), and the
    queue of calls not yet sent (a call handed back may also still run on a slow worker)."""

    def __init__(self, fns: tuple, calls: list, describe: Callable):
        self.fns, self.calls, self.describe = fns, calls, describe
        self.results: list[Outcome | None] = [None] * len(calls)
        self.queue = list(range(len(calls)))[::-1]  # popped from the end: first calls first
        self.unresolved = len(calls)

    @property
    def open(self) -> bool:
        return self.unresolved > 0

    def take(self, n: int) -> list[tuple]:
        out = []
        while self.queue and len(out) < n:
            i = self.queue.pop()
            if self.results[i] is None:
                out.append((i, *self.calls[i]))
        return out

    def requeue(self, indices: list[int]) -> None:
        self.queue.extend(i for i in reversed(indices) if self.results[i] is None)

    def resolve(self, index: int, outcome: Outcome) -> bool:
        """Record the call's outcome unless it has one; whether this one counts."""
        if self.results[index] is not None:
            return False
        self.results[index] = outcome
        self.unresolved -= 1
        return True


def _completion_of(args: tuple) -> str:
    return str(args[1]) if len(args) > 1 else str(args)


_shared: BoundedPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> BoundedPool:
    """The process's pool for correctness decisions (started on first use, closed at exit)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BoundedPool()
            atexit.register(_shared.close)
        return _shared


# ---- the worker process -----------------------------------------------------------------------------------------

def _limit_self(memory_mb: int) -> None:
    """Cap this process's address space, and die with the parent (an orphan computing 10^10^10 would keep a
    core)."""
    import ctypes
    import resource
    import signal

    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:
        os._exit(0)


def _serve() -> None:
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a function's print() must not corrupt the frames
    _limit_self(int(os.environ.get("FLEETRL_BOUNDED_MEMORY_MB", DEFAULT_MEMORY_MB)))
    # math-verify warns on every call that its own signal timeout is off: this process is the timeout
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import rewards.answers  # noqa: F401 - warm: math-verify and sympy imported before the first deadline
    from rewards.answers import parse_math

    parse_math("$1$")

    def write(obj) -> None:
        data = pickle.dumps(obj)
        out.write(struct.pack("<Q", len(data)) + data)

    write("ready")
    stdin = sys.stdin.buffer
    while True:
        head = stdin.read(8)
        if len(head) < 8:
            return
        fns, calls = pickle.loads(stdin.read(struct.unpack("<Q", head)[0]))
        for index, f, args in calls:
            write([(index, *_call(fns[f], args))])  # before the next call begins: the deadline is that call's


def _call(fn: Callable, args: tuple) -> tuple[str, object]:
    try:
        value = fn(*args)
        pickle.dumps(value)
        return "ok", value
    except MemoryError:
        return "error", "the call ran out of its memory limit"
    except Exception as e:  # noqa: BLE001 - a user's function may raise anything
        import traceback

        return "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


if __name__ == "__main__":
    _serve()
