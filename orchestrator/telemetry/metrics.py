"""Run outputs: metrics.jsonl (one object per step), TensorBoard events, a PNG progress plot, console lines."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path


class PhaseTimer:
    """Wall-clock seconds per named phase of one step: ``with timer("generate"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}_s": v for k, v in self.seconds.items()}
        out["time/step_s"] = time.perf_counter() - self.start
        return out


class MetricsLogger:
    """``metrics.jsonl`` (the run's record, one object per step), the progress plot, and the trackers of
    ``run.loggers`` (:mod:`orchestrator.telemetry.trackers`)."""

    def __init__(self, run_dir: Path, plot_every: int, keep_before: int = 0, loggers: tuple[str, ...] = ("jsonl",),
                 params: dict | None = None):
        """``keep_before``: on resume, keep the existing rows of steps before it and drop the rest."""
        from orchestrator.telemetry.trackers import make_trackers

        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.history: list[dict] = []
        if keep_before and self.path.exists():
            rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            self.history = [r for r in rows if r["step"] < keep_before]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        self.trackers = make_trackers(list(loggers), run_dir, params or {})
        self.plot_every = plot_every

    def log(self, metrics: dict) -> None:
        from orchestrator.telemetry.trackers import finite_numbers

        clean = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                 for k, v in metrics.items()}
        clean["step"] = int(metrics["step"])
        self.history.append(clean)
        with self.path.open("a") as f:
            f.write(json.dumps(clean, allow_nan=True) + "\n")
        numbers = finite_numbers(clean)
        for tracker in self.trackers:
            tracker.log(numbers, clean["step"])
        if clean["step"] % self.plot_every == 0:
            self.plot()

    def log_samples(self, records: list[dict], step: int) -> None:
        """A few eval completions with their verdicts (:mod:`orchestrator.telemetry.samples`) as text in the
        trackers that show text."""
        if records:
            for tracker in self.trackers:
                if hasattr(tracker, "log_text"):
                    tracker.log_text("eval/samples", records, step)

    def plot(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        steps = [m["step"] for m in self.history if "reward/mean" in m]
        ax.plot(steps, [m["reward/mean"] for m in self.history if "reward/mean" in m], label="train reward (mean)")
        ev = [(m["step"], m["eval/accuracy"]) for m in self.history if "eval/accuracy" in m]
        if ev:
            ax.plot(*zip(*ev), "o-", label="held-out eval accuracy (greedy)")
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title(self.run_dir.name)
        out = self.run_dir / "progress.png"
        fig.tight_layout()
        fig.savefig(out, dpi=90)
        plt.close(fig)
        return out

    def close(self) -> None:
        self.plot()
        for tracker in self.trackers:
            tracker.close()


def progress_line(m: dict) -> str:
    ev = "".join(f" {name} {m[k]:.3f}" for k, name in (("eval/accuracy", "eval"), ("prm/auc", "eval auc")) if k in m)
    if "reward/mean" not in m:  # a supervised step (SFT, offline DPO, PRM training) or the final eval
        parts = [f"{k} {m[k]:.4f}" for k in ("sft/nll", "dpo/loss", "dpo/preference_accuracy", "prm/bce",
                                              "prm/accuracy") if k in m]
        if not parts:
            return f"step {m['step']:>4} v{m['policy_version']}{ev} (eval only)"
        return (f"step {m['step']:>4}{ev} {' '.join(parts)} | learn {m.get('time/learn_s', 0):.2f}s"
                f" step_time {m.get('time/step_s', 0):.2f}s")
    kl = m.get("kl", float("nan"))  # only when a reference model is kept (a KL term, or learner.log_kl)
    sync = m.get("weight_sync/logprob_max_diff", float("nan"))
    return (f"step {m['step']:>4} v{m['policy_version']} reward {m.get('reward/mean', float('nan')):.3f}"
            f" acc {m.get('train/accuracy', float('nan')):.3f}{ev} loss {m.get('loss', float('nan')):+.4f}"
            + (f" kl {kl:.4f}" if kl == kl else "") + f" sync_diff {sync:.1e}"
            + (f" | wait {m['async/waited_s']:.2f}s stale {m['async/staleness_max']:.0f}"  # async: no generate phase
               if "async/waited_s" in m else f" | gen {m.get('time/generate_s', 0):.2f}s")
            + f" learn {m.get('time/learn_s', 0):.2f}s"
            f" sync {m.get('time/sync_s', 0):.2f}s step_time {m.get('time/step_s', 0):.2f}s"
            f" tok/s {m.get('throughput/tokens_per_s', 0):.0f}")
