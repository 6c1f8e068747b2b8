"""Run an untrusted Python program on stdin/stdout test cases, isolated from the host and from the caller.

One sandbox per call, holding all of its cases (one process start per completion, not per case)::

    setpriv --pdeathsig KILL unshare --pid --net --mount --ipc --uts --fork --kill-child --mount-proc \\
        python -I -S rewards/sandbox_harness.py          # the job arrives on stdin, statuses leave on stdout

The harness (:mod:`rewards.sandbox_harness`) is trusted code running as root, PID 1 of fresh PID, network,
mount, IPC and UTS namespaces. It builds a throwaway root (a tmpfs with /usr, /lib*, /bin, /etc and the
interpreter's prefix bound read-only, a private /proc, four device nodes), chroots into it, then runs the
program once per case as an unprivileged uid that owns nothing on the host, with a fresh size-capped tmpfs
as its working dir, /tmp and /dev/shm (the only places it can write), under rlimits:

- CPU time (``RLIMIT_CPU``), address space (``RLIMIT_AS``), processes + threads (``RLIMIT_NPROC``: applies
  because the uid is not root; every concurrent sandbox on the host gets its own uid, so a fork bomb cannot
  starve a neighbour), file size (``RLIMIT_FSIZE``), open files, no core dumps, ``no_new_privs``;
- a seccomp filter failing the kernel keyring calls (``add_key``, ``request_key``, ``keyctl``): keyrings are kept
  per uid, not per namespace, so a key stored by one program would otherwise be read by the next program of its
  uid (the next case, or a later sandbox given the same uid);
- a wall-clock limit per case and a cap on the bytes of stdout read; past either the case fails;
- after every case ``kill(-1, SIGKILL)`` from PID 1 clears every process of the namespace (fork-bomb children
  that called ``setsid`` included), so nothing survives into the next case or past the sandbox.

What this keeps out: the network (only a downed loopback exists, so even 127.0.0.1 is unreachable), the host
filesystem (not visible beyond the read-only system dirs; in particular no dataset or repository file the
expected outputs could be read from), the caller's processes (invisible in the PID namespace; PID 1 ignores
signals from inside it, and a non-root uid cannot signal root anyway). If the caller dies, ``--pdeathsig``
and ``--kill-child`` take the whole namespace down with it. The harness compares outputs itself, so the
expected outputs never reach the program and the program cannot write the harness's result.

Needs root (namespaces, chroot, uid switch). Where that is missing :func:`check_sandbox` raises
:class:`SandboxUnavailable`; nothing here ever falls back to running a program unsandboxed. Memory bound of
one sandbox: ``memory_mb * max_procs`` of address space plus ``3 * disk_mb`` of tmpfs.
"""

from __future__ import annotations

import fcntl
import marshal
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from rewards.sandbox_harness import outputs_match

__all__ = ["SandboxError", "SandboxLimits", "SandboxUnavailable", "check_sandbox", "outputs_match", "run_tests"]

DEFAULT_PYTHON = os.path.realpath(sys.executable)
UID_BASE = 60000
"""Sandbox uids are ``UID_BASE .. UID_BASE + UID_SLOTS - 1`` (Debian's on-demand range, unused in practice)."""
UID_SLOTS = 64
_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_harness.py")
SLOT_DIR = "/tmp/fleetrl-sandbox-slots"
"""Lock files that hand each concurrent sandbox on this host (any process) its own uid."""

STATUSES = ("pass", "wrong", "error", "timeout", "output_limit")
"""Per-case outcome: right output; wrong output; non-zero exit or killed by a signal (rlimit, syntax error,
exception); past the wall-clock limit; more stdout than ``max_output_kb``."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): bad set-up, budget exceeded, harness crash."""


class SandboxUnavailable(SandboxError):
    """This host cannot create the sandbox; programs are then never run."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox; every program process gets them."""

    timeout_s: float = 2.0
    """Wall-clock limit per test case, seconds (CPU-time limit: this rounded up, plus 1)."""
    memory_mb: int = 256
    """Address-space limit per process, MiB."""
    max_output_kb: int = 1024
    """Stdout read per case, KiB; more fails the case and stops the program."""
    max_procs: int = 16
    """Processes + threads the program may have at once (itself included)."""
    disk_mb: int = 64
    """Size of each of the program's writable dirs (working dir, /tmp, /dev/shm: tmpfs mounts, fresh every
    case), MiB; also the largest file."""
    python: str = DEFAULT_PYTHON
    """Interpreter for the program, run with ``-I -S`` (standard library only)."""

    def __post_init__(self):
        bounds = {"timeout_s": (0.01, 600), "memory_mb": (32, 1 << 20), "max_output_kb": (1, 1 << 20),
                  "max_procs": (1, 4096), "disk_mb": (1, 1 << 16)}
        for key, (lo, hi) in bounds.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise ValueError(f"sandbox limit {key}={value!r}: must be a number in [{lo}, {hi}]")
        if not os.path.isabs(self.python):
            raise ValueError(f"sandbox limit python={self.python!r}: must be an absolute path")


def run_tests(program: str, tests: list[dict], limits: SandboxLimits = SandboxLimits()) -> list[str]:
    """Run ``program`` on every ``{"input": str, "output": str}`` of ``tests`` in one sandbox; one status of
    :data:`STATUSES` per case. Blocks only on the sandbox process, so it is safe to call from many threads."""
    cases = [_checked_case(i, t) for i, t in enumerate(tests)]
    if not cases:
        raise ValueError("run_tests: no test cases")
    budget = len(cases) * (limits.timeout_s + 1.0) + 10.0
    with _uid_slot() as uid:
        job = marshal.dumps({"program": program, "cases": cases, "uid": uid, "limits": asdict(limits)})
        return _run_job(job, budget)


def _run_job(job: bytes, budget: float) -> list:
    """One sandbox process over a marshalled job; the per-case results the harness writes."""
    proc = subprocess.Popen(_sandbox_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(job, timeout=budget)
    except subprocess.TimeoutExpired:
        proc.kill()  # unshare dies -> --kill-child kills the namespace's PID 1 -> the kernel kills the rest
        proc.communicate()
        raise SandboxError(f"sandbox ran past its {budget:.0f}s budget and was killed") from None
    if proc.returncode != 0:
        raise SandboxError(f"sandbox failed (exit {proc.returncode}): {err.decode(errors='replace')[-2000:]}")
    return marshal.loads(out)


def run_program(program: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> tuple[str, str]:
    """Run ``program`` once in a fresh sandbox (the same isolation and limits as :func:`run_tests`) and return
    ``(status, stdout)``: status ``ok`` (exit 0), ``error``, ``timeout`` or ``output_limit``; stdout as far as it
    was read. For tools that execute code (``workers/envs/tools.py``); the program never runs in the caller."""
    if not isinstance(program, str) or not isinstance(stdin, str):
        raise ValueError("run_program: program and stdin must be strings")
    with _uid_slot() as uid:
        job = marshal.dumps({"program": program, "cases": [{"input": stdin, "output": None}], "uid": uid,
                             "limits": asdict(limits)})
        return _run_job(job, limits.timeout_s + 11.0)[0]


def _checked_case(i: int, test) -> dict:
    if not isinstance(test, dict) or not isinstance(test.get("input"), str) or not isinstance(
            test.get("output"), str):
        raise ValueError(f"test case {i}: expected {{'input': str, 'output': str}}, got {test!r:.200}")
    return {"input": test["input"], "output": test["output"]}


def _sandbox_command() -> list[str]:
    return ["setpriv", "--pdeathsig", "KILL", "unshare", "--pid", "--net", "--mount", "--ipc", "--uts", "--fork",
            "--kill-child", "--mount-proc", os.path.realpath(sys.executable), "-I", "-S", _HARNESS]


@contextmanager
def _uid_slot() -> Iterator[int]:
    """A uid no other live sandbox on this host uses: the first free ``flock`` among :data:`UID_SLOTS` files
    (released when the holder finishes or dies, so a killed worker leaks nothing)."""
    os.makedirs(SLOT_DIR, mode=0o700, exist_ok=True)
    for slot in range(UID_SLOTS):
        fd = os.open(os.path.join(SLOT_DIR, f"{slot}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield UID_BASE + slot
        finally:
            os.close(fd)
        return
    raise SandboxError(f"all {UID_SLOTS} sandbox uids are busy; lower the number of concurrent reward calls")


_checked: set[str] = set()
_check_lock = threading.Lock()


def check_sandbox(python: str = DEFAULT_PYTHON) -> None:
    """Raise :class:`SandboxUnavailable`, saying what is missing, unless a probe program runs and is judged
    correctly in the sandbox. Call it when a worker starts; it runs once per interpreter per process."""
    with _check_lock:
        if python in _checked:
            return
        hint = ("it needs root with CAP_SYS_ADMIN, CAP_SYS_CHROOT and CAP_SETUID (in Docker: --cap-add SYS_ADMIN or "
                "--privileged) and util-linux's unshare and setpriv; the code reward never runs programs outside "
                "the sandbox")
        if os.geteuid() != 0:
            raise SandboxUnavailable(f"the code sandbox needs root, running as uid {os.geteuid()} ({hint})")
        for tool in ("unshare", "setpriv"):
            if shutil.which(tool) is None:
                raise SandboxUnavailable(f"the code sandbox needs {tool!r} on PATH ({hint})")
        probe = [{"input": "7\n", "output": "14"}, {"input": "1\n", "output": "3"}]
        try:
            got = run_tests("print(2 * int(input()))", probe, SandboxLimits(timeout_s=10.0, python=python))
        except SandboxError as e:
            raise SandboxUnavailable(f"the code sandbox cannot be created here: {e} ({hint})") from e
        if got != ["pass", "wrong"]:
            raise SandboxUnavailable(f"the code sandbox misjudged its probe program: {got} ({hint})")
        _checked.add(python)
