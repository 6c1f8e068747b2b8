"""Experiment trackers behind ``run.loggers``: TensorBoard, Weights & Biases, MLflow, each through its own library.

Every tracker gets the same step metrics under the same names as ``metrics.jsonl`` (finite numbers only) and the
resolved config as params. W&B and MLflow are imported only when selected. A resumed run continues the same
W&B / MLflow run: their ids are kept in ``<run.dir>/trackers.json``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, run_dir: Path, params: dict, ids: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in flatten(params).items()), 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_text(self, tag: str, records: list[dict], step: int) -> None:
        from orchestrator.telemetry.samples import as_text

        self.writer.add_text(tag, as_text(records), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """``run.wandb_mode: offline`` writes ``<run.dir>/wandb/offline-run-*/`` with no network (``wandb sync`` it
    later); ``online`` needs a W&B login."""

    def __init__(self, run_dir: Path, params: dict, ids: dict):
        import wandb

        run_cfg = params["run"]
        self.run = wandb.init(project=run_cfg["wandb_project"], entity=run_cfg["wandb_entity"],
                              name=run_cfg["wandb_name"] or run_dir.name, tags=run_cfg["wandb_tags"] or None,
                              dir=str(run_dir), mode=run_cfg["wandb_mode"], config=params, id=ids.get("wandb"),
                              resume="allow",
                              settings=wandb.Settings(console="off", silent=True))
        ids["wandb"] = self.run.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_text(self, tag: str, records: list[dict], step: int) -> None:
        import wandb

        columns = ["prompt", "completion", "answer", "correct"]
        self.run.log({tag: wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in records])},
                     step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """The tracking URI is ``run.mlflow_tracking_uri``, else MLflow's own ``MLFLOW_TRACKING_URI``, else SQLite at
    ``<run.dir>/mlflow.db``; the experiment is ``MLFLOW_EXPERIMENT_NAME`` when set and ``run.mlflow_experiment``
    is left at its default, else ``run.mlflow_experiment``; run name = the run dir's name; params are the
    flattened resolved config."""

    def __init__(self, run_dir: Path, params: dict, ids: dict):
        import logging

        from mlflow.tracking import MlflowClient

        mlflow_log = logging.getLogger("mlflow")  # MLflow prints to stderr itself; send it to the driver's log
        mlflow_log.handlers.clear()
        mlflow_log.propagate = True
        run_cfg = params["run"]
        self.uri = (run_cfg["mlflow_tracking_uri"] or os.environ.get("MLFLOW_TRACKING_URI")
                    or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
        self.client = MlflowClient(self.uri)
        if ids.get("mlflow"):
            self.run_id = ids["mlflow"]
            return
        name = run_cfg["mlflow_experiment"]
        if name == "fleetrl" and os.environ.get("MLFLOW_EXPERIMENT_NAME"):
            name = os.environ["MLFLOW_EXPERIMENT_NAME"]
        exp = self.client.get_experiment_by_name(name)
        local = not (run_cfg["mlflow_tracking_uri"] or os.environ.get("MLFLOW_TRACKING_URI"))
        artifacts = (run_dir / "mlflow-artifacts").resolve().as_uri() if local else None  # else the server's
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name, artifact_location=artifacts)
        self.run_id = ids["mlflow"] = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        flat = [(k, str(v)[:6000]) for k, v in flatten(params).items()]
        from mlflow.entities import Param

        for i in range(0, len(flat), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in flat[i:i + 100]])

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def log_text(self, tag: str, records: list[dict], step: int) -> None:
        from orchestrator.telemetry.samples import as_text

        self.client.log_text(self.run_id, as_text(records), f"{tag}/step_{step:06d}.md")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS: dict[str, Callable[[Path, dict, dict], Tracker]] = {
    "tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
"""``run.loggers`` names besides ``jsonl`` (which :class:`orchestrator.telemetry.metrics.MetricsLogger` writes
itself)."""


def make_trackers(names: list[str], run_dir: Path, params: dict) -> list[Tracker]:
    """The selected trackers, continuing the run's earlier W&B / MLflow runs (ids in ``trackers.json``)."""
    path = run_dir / "trackers.json"
    ids = json.loads(path.read_text()) if path.exists() else {}
    out = [TRACKERS[n](run_dir, params, ids) for n in names if n != "jsonl"]
    path.write_text(json.dumps(ids))
    return out


def finite_numbers(metrics: dict) -> dict[str, float]:
    """The metrics a tracker can plot: finite numbers (not ``step``, not strings)."""
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def flatten(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (the dotted keys of config overrides)."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
