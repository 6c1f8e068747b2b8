"""Start-up: how long a user waits from `fleetrl train` to the actors being up and to the first step, before and
after a change, side by side on this machine.

    python -m bench.startup                       # this checkout, 3 runs of each config
    python -m bench.startup --before a7e41a6      # the same runs of an older commit (a git worktree) first
    python -m bench.startup --profile             # where the start-up goes (this checkout, default config)
    python -m bench.startup --fresh --before X    # as on a fresh machine: no JIT-built op cached from earlier runs
    python -m bench.startup --before X --after Y --cases sft,reward_model,r1_pipeline --name startup_fleet

``--after Y``: the second side from a worktree of commit Y instead of this checkout (so the checkout can change while
it runs). Each run is `fleetrl train -c CONFIG trainer.total_steps=1` in its own process with a private local Ray
instance, timed from outside the same way for any commit: launch -> the banner (printed once every actor is
up) -> the first training step's row in metrics.jsonl -> exit. Medians over the runs. ``--fresh`` gives each run
an empty torch extensions cache (``TORCH_EXTENSIONS_DIR``), as a new user's first run and a clean CI machine have.
``--profile`` times the driver's phases in-process and reads every actor's CPU seconds when all are ready.

The ``sft`` and ``reward_model`` cases are a supervised stage without evals (`fleetrl train algorithm.name=sft
sft.data=...` on 64 cold-start rows, `algorithm.name=reward_model` on 160 preference pairs). ``r1_pipeline`` is
`fleetrl pipeline -c configs/r1.yaml trainer.total_steps=2 data.eval_size=32`: five stages, each with an eval
before and after; it reports the wall time and the sum of the stages' own start-up (``startup_s`` of each stage's
summary.json: config loaded -> actors ready for that stage).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import PY, RUNS_DIR, SUBPROCESS_ENV, parse_args, save_result

ROOT = Path(__file__).resolve().parents[1]
# the step-0 eval is kept for the default config (it is part of what a user waits for); the larger models' evals
# would measure generation, not start-up
CASES = {
    "default": ("configs/default.yaml", []),
    "smollm2": ("configs/smollm2_arith.yaml", ["trainer.eval_every=0"]),
    "tool": ("configs/tool_calc.yaml", ["trainer.eval_every=0"]),
    # a supervised stage without evals ({{}}: the default config's GRPO keys do not carry over to another algorithm)
    "sft": ("configs/default.yaml", ["algorithm={{}}", "algorithm.name=sft", "sft.data={sft_data}",
                                     "trainer.eval_every=0"]),
    "reward_model": ("configs/default.yaml", ["algorithm={{}}", "algorithm.name=reward_model",
                                              "algorithm.pairs={pairs}", "trainer.eval_every=0"]),
}
PIPELINE = ["pipeline", "-c", "configs/r1.yaml", "trainer.total_steps=2", "data.eval_size=32"]


def stage_data() -> dict[str, str]:
    """The SFT rows and preference pairs the ``sft`` and ``reward_model`` cases train on (written once)."""
    import random

    from orchestrator.config import load_config
    from orchestrator.recipes.cold_start import write_cold_start
    from rewards.tasks import make_task

    out = (RUNS_DIR / "startup-data").resolve()
    sft, pairs = out / "sft.jsonl", out / "pairs.jsonl"
    if not sft.exists():
        write_cold_start(load_config(None, []).data, 64, sft)
    if not pairs.exists():
        rng = random.Random(0)
        rows = [{"prompt": p.text, "chosen": p.metadata["answer"],
                 "rejected": str(int(p.metadata["answer"]) * 10 + rng.randrange(10))}
                for p in make_task("arithmetic").train_batch(0, 160)]
        pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"sft_data": str(sft), "pairs": str(pairs)}


def timed_pipeline(code: Path, run_dir: Path) -> dict:
    """One R1 pipeline smoke run of ``code``: its wall time and the sum of its stages' start-up."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ, **SUBPROCESS_ENV, PYTHONPATH=str(code))
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    proc = subprocess.run([PY, "-m", "orchestrator", *PIPELINE, f"run.dir={run_dir}"], cwd=code, env=env,
                          capture_output=True, text=True)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"pipeline failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    stages = sorted(p for p in run_dir.iterdir() if (p / "summary.json").exists())
    summaries = [json.loads((p / "summary.json").read_text()) for p in stages]
    startup = [s["startup_s"] for s in summaries]
    return {"wall_s": round(total, 1), "startup_sum_s": round(sum(startup), 1), "stage_startup_s": startup,
            "stage_eval_accuracy": [[s["eval_accuracy_first"], s["eval_accuracy_last"]] for s in summaries]}


def timed_run(code: Path, config: str, overrides: list[str], run_dir: Path, fresh: bool = False) -> dict:
    """One `fleetrl train` of ``code`` (a checkout): seconds from launch to the banner, the first step, exit."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ, **SUBPROCESS_ENV, PYTHONPATH=str(code))
    if fresh:
        env["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="fleetrl-fresh-ext-")
    env.pop("RAY_ADDRESS", None)
    cmd = [PY, "-m", "orchestrator", "train", "-c", config, f"run.dir={run_dir}", "trainer.total_steps=1",
           *overrides]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    banner = None
    for line in proc.stdout:
        if banner is None and line.startswith("fleetrl  "):
            banner = time.perf_counter() - t0
        if line.startswith("step "):
            break
    first_step = time.perf_counter() - t0
    rest = proc.communicate()[0]
    total = time.perf_counter() - t0
    if proc.returncode != 0 or banner is None:
        raise RuntimeError(f"{cmd} failed ({proc.returncode}):\n{rest[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    own = next((r for r in rows if "time/startup_s" in r), {})  # fleetrl's own figures (newer commits)
    return {"actors_up_s": round(banner, 1), "first_step_s": round(first_step, 1), "exit_s": round(total, 1),
            "startup_s_logged": own.get("time/startup_s"), "first_step_s_logged": own.get("time/first_step_s")}


def checkout(rev: str) -> Path:
    """A worktree of ``rev`` beside this checkout's models (.fleetrl)."""
    path = Path(tempfile.gettempdir()) / f"fleetrl-startup-{rev}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True,
                       capture_output=True)
    link = path / ".fleetrl"
    if not link.exists():
        link.symlink_to(ROOT / ".fleetrl")
    return path


def measure(label: str, code: Path, cases: list[str], repeats: int, fresh: bool = False) -> dict:
    out, data = {}, stage_data()
    for case in cases:
        runs = []
        for i in range(repeats):
            run_dir = (RUNS_DIR / f"startup-{label}-{case}-{i}").resolve()
            if case == "r1_pipeline":
                runs.append(timed_pipeline(code, run_dir))
            else:
                config, overrides = CASES[case]
                runs.append(timed_run(code, config, [o.format(**data) for o in overrides], run_dir, fresh))
            print(f"{label:>8} {case:>8} run {i}: {runs[-1]}", flush=True)
        out[case] = {"runs": runs, **{k: statistics.median(r[k] for r in runs) for k in runs[0]
                                      if isinstance(runs[0][k], float)}}
    return out


def profile() -> dict:
    """The default config's start-up, phase by phase, in this process; and each process's CPU seconds once
    every actor is ready."""
    import psutil

    t0 = time.perf_counter()
    phases = {}

    def lap(name: str) -> None:
        phases[name] = round(time.perf_counter() - t0 - sum(phases.values()), 2)

    from orchestrator.config import load_config
    from orchestrator.loops.policy import PolicyLoop
    from orchestrator.rl.driver import Run
    from orchestrator.rl.launch import init_ray
    from orchestrator.telemetry.console import Console
    lap("driver imports")
    run_dir = (RUNS_DIR / "startup-profile").resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config("configs/default.yaml", [f"run.dir={run_dir}"])
    trainer = Run(cfg, PolicyLoop, None, Console())
    lap("task and tokenizer (driver)")
    init_ray(cfg)
    lap("ray.init (a private local instance)")
    import ray

    from orchestrator.rl.fleet import Fleet, Roles
    fleet = Fleet(cfg, Roles(learner=True, rollout=True, reward=True))  # created, not waited for
    groups = {"learner ranks": fleet.learner, "vLLM engines": fleet.rollouts, "reward actor": fleet.rewards}
    lap("actors created (placement group, spawn)")
    pending = {name: g.ready() for name, g in groups.items()}
    ready = {}
    while pending:
        for name, refs in list(pending.items()):
            if not ray.wait(refs, num_returns=len(refs), timeout=0)[1]:
                ready[name] = round(time.perf_counter() - t0, 1)
                del pending[name]
        time.sleep(0.1)
    lap("until every actor is ready")
    cpu = {}
    for p in psutil.process_iter(["cmdline", "cpu_times"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith("ray::") or p.pid == os.getpid():
            t = p.info["cpu_times"]
            key = cmd.split()[0] if cmd.startswith("ray::") else "driver"
            cpu.setdefault(key, []).append(round(t.user + t.system, 1))
    del trainer
    ray.shutdown()
    return {"phases_s": phases, "ready_at_s": ready, "cpu_s": cpu}


def main(argv: list[str] | None = None) -> None:
    def extra(ap):
        ap.add_argument("--before", help="a commit to measure first, side by side (a git worktree)")
        ap.add_argument("--repeats", type=int, default=3)
        ap.add_argument("--after", help="measure this commit (a git worktree) instead of this checkout")
        ap.add_argument("--cases", default="default,smollm2,tool",
                        help=f"comma-separated, of {', '.join(CASES)}, r1_pipeline")
        ap.add_argument("--profile", action="store_true", help="only the phase breakdown of this checkout")
        ap.add_argument("--fresh", action="store_true", help="each run with an empty torch extensions cache")
        ap.add_argument("--name", default="startup", help="the result file: bench/results/NAME.json")

    args = parse_args(__doc__, argv, extra)
    if args.profile:
        result = profile()
        print(json.dumps(result, indent=1))
        save_result("startup_profile", args.quick, result)
        return
    cases, repeats = args.cases.split(","), 1 if args.quick else args.repeats
    result = {"repeats": repeats, "fresh": args.fresh}
    if args.before:
        result["before"] = {"commit": args.before,
                            **measure("before", checkout(args.before), cases, repeats, args.fresh)}
    if args.after:
        result["after_commit"] = args.after
    result["after"] = measure("after", checkout(args.after) if args.after else ROOT, cases, repeats, args.fresh)
    for case in cases:
        line = [f"{case:>8}"] + [f"{side}: " + ", ".join(f"{k} {v}" for k, v in result[side][case].items()
                                                        if k != "runs") for side in ("before", "after")
                                 if side in result]
        print(" | ".join(line))
    save_result(args.name, args.quick, result)


if __name__ == "__main__":
    sys.exit(main())
