"""Each actor's own output (vLLM, DeepSpeed, transformers, Python warnings, C++ prints) goes to
``<run.dir>/logs/<actor name>.log`` instead of the driver's console.

The driver puts the log directory in the actor's environment (:data:`LOG_DIR_ENV`, see :func:`actor_env`); the
actor's ``__init__`` calls :func:`capture_output` first, which points file descriptors 1 and 2 at the log file (so
output from C extensions is caught too). With :data:`TEE_ENV` set (``run.verbose``) the output also still reaches
the process's original stdout, which Ray forwards to the driver's console. Outside Ray, or without the variable,
nothing changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

LOG_DIR_ENV = "FLEETRL_LOG_DIR"
TEE_ENV = "FLEETRL_LOG_TEE"


def actor_env(log_dir: str | None, verbose: bool) -> dict[str, str]:
    """Environment variables that make an actor write its output under ``log_dir``."""
    if not log_dir:
        return {}
    return {LOG_DIR_ENV: os.path.abspath(log_dir), **({TEE_ENV: "1"} if verbose else {})}


def log_path(log_dir: str, name: str) -> str:
    return os.path.join(log_dir, f"{name}.log")


class LoggedActor:
    """Base of fleetrl's actor classes: ``_start_logging()`` in ``__init__``; ``repr`` = the actor's Ray name, which
    Ray uses in console prefixes; ``peak_rss_mb`` for the run summary; ``ready`` for the start-up barrier."""

    name = ""

    def _start_logging(self) -> None:
        self.name = _actor_name()
        capture_output(self.name)

    def __repr__(self) -> str:
        return self.name or type(self).__name__

    def log_to(self, log_dir: str) -> str | None:
        """From now on write this actor's output under ``log_dir`` (another run on the same fleet)."""
        os.environ[LOG_DIR_ENV] = os.path.abspath(log_dir)
        return capture_output(self.name)

    def peak_rss_mb(self) -> float:
        """Peak resident memory of this actor's process, MB."""
        return peak_rss_mb()

    def ready(self) -> str:
        """Returns (its name) once the constructor has finished: the start-up barrier."""
        return self.name


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MB (``ru_maxrss``)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def capture_output(name: str) -> str | None:
    """Send this process's stdout and stderr to ``<log dir>/<name>.log`` (appending: a restarted actor continues
    its file after a header line). Returns the path, or None when no log dir is set."""
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir or not name:
        return None
    os.makedirs(log_dir, exist_ok=True)
    path = log_path(log_dir, name)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, f"==== {name} (pid {os.getpid()}) started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    if os.environ.get(TEE_ENV):
        os.close(fd)
        fd = _tee(path)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    return path


_tees: list = []


def _tee(path: str) -> int:
    """The write end of a pipe into coreutils ``tee -a path``, whose stdout is this process's original stdout. It
    is a separate process so it drains everything written, even when this process is killed."""
    proc = subprocess.Popen(["tee", "-a", path], stdin=subprocess.PIPE, stdout=1, stderr=subprocess.DEVNULL)
    _tees.append(proc)
    return os.dup(proc.stdin.fileno())


def _actor_name() -> str:
    """This actor's Ray name ('' outside Ray)."""
    try:
        import ray

        if not ray.is_initialized():  # built outside Ray (benchmarks, unit tests)
            return ""
        return ray.get_runtime_context().get_actor_name() or ""
    except Exception:  # noqa: BLE001 - not in a Ray worker
        return ""
