"""What the driver shows on the console, and where everything else goes.

By default the console holds fleetrl's own output: a start banner, a live progress bar of the steps (ETA, reward,
accuracy, s/step; in a non-TTY such as a Ray job log or CI, one plain line per step instead), one line per eval,
and the warnings that matter (an actor restarted, a step skipped, reward errors). Every actor's own output is in
``<run.dir>/logs/<actor>.log`` (:mod:`common.actor_logs`), the driver's full log in ``logs/driver.log``.
``run.verbose`` (``fleetrl train --verbose``) shows everything on the console as well.

An actor that fails is named in the error the user sees, with the path of its log (:func:`describe_failure`).
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.telemetry.metrics import progress_line

if TYPE_CHECKING:
    from orchestrator.config import FleetConfig

_ACTORS: dict[str, tuple[str, str]] = {}
"""Ray actor id (hex) and actor name -> (actor name, its log file), for naming failed actors."""


def log_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "logs"


def remember_actor(handle, name: str, run_dir: str | Path) -> None:
    _ACTORS[handle._actor_id.hex()] = _ACTORS[name] = (name, str(log_dir(run_dir) / f"{name}.log"))


def actor_label(x) -> str | None:
    """``"rollout-0 (its log: runs/x/logs/rollout-0.log)"`` for an actor's name, its handle, or the error Ray
    raises when it died (which carries its id)."""
    key = x if isinstance(x, str) else getattr(x, "actor_id", None) or (
        x._actor_id.hex() if hasattr(x, "_actor_id") else None)
    if key not in _ACTORS:
        return None
    name, path = _ACTORS[key]
    return f"{name} (its log: {path})"


class ActorFailed(RuntimeError):
    """A fleetrl actor's method raised, or the actor died: the message names the actor and its log file."""


def actor_failed(who, error: BaseException) -> ActorFailed:
    """``who``: the actor's name or handle; ``error``: what Ray raised."""
    return ActorFailed(f"{actor_label(who) or who} failed: {error_summary(error)}")


def describe_failure(error: BaseException) -> str | None:
    """One message naming the actor behind ``error`` (or an exception it caused) and its log file; None when no
    known actor is involved."""
    import ray

    seen = error
    while seen is not None:
        if isinstance(seen, ActorFailed):
            return str(seen)
        if isinstance(seen, ray.exceptions.RayError) and (label := actor_label(seen)):
            return f"{label} failed: {error_summary(seen)}"
        seen = seen.__cause__ or seen.__context__
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED = re.compile(r"^\s*[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b[^:]*:")


def error_summary(error: BaseException) -> str:
    """The exception an actor raised (for a Ray task error, its cause), on one line, without terminal colour
    codes. An actor that died in its constructor surfaces as a generic first line: the exception at the end of its
    traceback is added as the cause."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):  # RayTaskError: the exception the actor raised
        text = _ANSI.sub("", str(cause)).strip()
        return f"{type(cause).__name__}: {text.splitlines()[0][:300] if text else ''}"
    lines = _ANSI.sub("", str(error)).strip().splitlines()
    first = lines[0][:300] if lines else ""
    raised = [line.strip() for line in lines[1:] if _RAISED.match(line)]
    detail = f" (cause: {raised[-1][:300]})" if raised else ""
    return f"{type(error).__name__}: {first}{detail}"


class _ConsoleHandler(logging.Handler):
    """Log records on the console without breaking the progress bar."""

    def __init__(self, console: Console):
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class Console:
    """The driver's console. ``live``: a progress bar redrawn in place (a TTY); otherwise plain lines."""

    def __init__(self, stream=None, verbose: bool = False):
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self.verbose = verbose
        self.bar = None

    def print(self, line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line, file=self.stream)
        self.stream.flush()

    def setup_logging(self, run_dir: Path) -> Path:
        """Everything the driver process logs goes to ``logs/driver.log``; the console gets fleetrl's warnings
        (everything, with ``verbose``). Python warnings are logged too. Returns the driver log's path."""
        logs = log_dir(run_dir)
        logs.mkdir(parents=True, exist_ok=True)
        path = logs / "driver.log"
        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        root.setLevel(logging.INFO)
        to_file = logging.FileHandler(path)
        to_file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        root.addHandler(to_file)
        to_console = _ConsoleHandler(self)
        to_console.setFormatter(logging.Formatter("%(levelname)s %(message)s" if not self.verbose
                                                  else "%(asctime)s %(name)s %(levelname)s %(message)s"))
        if not self.verbose:
            to_console.addFilter(lambda r: r.name.startswith("fleetrl") and r.levelno >= logging.WARNING)
        root.addHandler(to_console)
        logging.captureWarnings(True)
        return path

    def start(self, total_steps: int, start_step: int) -> None:
        import shutil

        from tqdm import tqdm

        width = shutil.get_terminal_size((0, 0)).columns  # 0 in a pseudo-terminal with no size set
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", file=self.stream,
                        dynamic_ncols=width > 0, ncols=None if width > 0 else 100, disable=not self.live,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")

    def step(self, m: dict) -> None:
        """One step's metrics: a progress-bar update (live), or the step's line (plain)."""
        if not self.live:
            self.print(progress_line(m))
            return
        if "eval/accuracy" in m:
            self.print(eval_line(m))
        if "reward/mean" in m and self.bar is not None:
            self.bar.set_postfix_str(_postfix(m), refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def eval_line(m: dict) -> str:
    extra = "".join(f" {k.split('/', 1)[1]} {m[k]:.3f}" for k in sorted(m)
                    if k.startswith("eval/") and k != "eval/accuracy" and isinstance(m[k], float))
    return f"eval  step {m['step']:>4}  accuracy {m['eval/accuracy']:.3f}{extra}"


def sample_line(step: int, record: dict) -> str:
    """One eval completion and its verdict (``trainer.show_samples``), on one line."""
    text = record["completion"].replace("\n", "\\n")
    text = text if len(text) <= 100 else text[:100] + "..."
    prompt = record["prompt"].replace("\n", " ")[-60:]
    return (f"eval  step {step:>4}  {'right' if record['correct'] else 'wrong'} (answer {record['answer']}): "
            f"...{prompt!r} -> {text!r}")


def _postfix(m: dict) -> str:
    return (f"reward {m.get('reward/mean', float('nan')):.3f} acc {m.get('train/accuracy', float('nan')):.3f}"
            f" {m.get('time/step_s', float('nan')):.2f}s/step")


def banner(cfg, actors: str, dashboard: str | None, startup_s: float | None = None) -> list[str]:
    """The lines printed once the actors are up: roles and counts (:meth:`orchestrator.rl.fleet.Fleet.describe`),
    how long they took, and where to look."""
    run = Path(cfg.run.dir)
    lines = [
        f"fleetrl  {cfg.algorithm.name}, {cfg.trainer.total_steps} steps, model {cfg.model.source or cfg.model.path}",
        f"  actors       {actors}"
        + (f"; up {startup_s:.1f} s after the config was loaded" if startup_s is not None else ""),
        f"  run dir      {run}  (metrics.jsonl, progress.png, final/)",
        f"  logs         {log_dir(run)}/<actor>.log, driver.log",
    ]
    if "tensorboard" in cfg.run.loggers:
        lines.append(f"  tensorboard  tensorboard --logdir {run / 'tensorboard'}")
    if "wandb" in cfg.run.loggers:
        lines.append(f"  wandb        {run / 'wandb'} ({cfg.run.wandb_mode})")
    if "mlflow" in cfg.run.loggers:
        lines.append(f"  mlflow       {cfg.run.mlflow_tracking_uri or 'sqlite:///' + str(run / 'mlflow.db')}")
    if dashboard:
        lines.append(f"  dashboard    {dashboard}")
    return lines


def slow_bf16_warning(cfg: FleetConfig, cpuinfo: str | None = None) -> str | None:
    """A warning when bfloat16 is configured on a CPU without native bf16 (no AVX512_BF16 or AMX): there bf16
    matrix products are emulated (measured 50x slower than fp32 on an AVX2-only AMD EPYC). None otherwise, or on
    a GPU machine."""
    bf16 = [k for k, v in (("rollout.dtype", cfg.engine_dtype), ("learner.mixed_precision",
                                                                  cfg.learner.mixed_precision),
                           ("model.dtype", cfg.model.dtype)) if v == "bfloat16"]
    import torch

    if not bf16 or torch.cuda.is_available():
        return None
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = set(next((line.split(":", 1)[1] for line in cpuinfo.splitlines() if line.startswith("flags")),
                     "").split())
    if flags & {"avx512_bf16", "amx_bf16"}:
        return None
    return (f"{', '.join(bf16)} = bfloat16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in "
            "/proc/cpuinfo): bf16 matrix products are emulated here and much slower than float32; consider "
            f"{' '.join(f'{k}=float32' if k != 'learner.mixed_precision' else f'{k}=null' for k in bf16)}")
