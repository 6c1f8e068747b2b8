"""The run's status, as the driver states it (never parsed from a log): after every step the driver writes
``<run.dir>/status.json`` atomically and puts the same record in the Ray cluster's key-value store (GCS) under
``fleetrl/status/<run name>``, where ``fleetrl status`` reads it, while the run goes and after it ended."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

KV_NAMESPACE = "fleetrl"
FIELDS = {"step": "step", "policy_version": "policy_version", "reward/mean": "reward",
          "train/accuracy": "train_accuracy", "eval/accuracy": "eval_accuracy",
          "throughput/tokens_per_s": "tokens_per_second", "time/step_s": "step_seconds",
          "rollout/workers": "rollout_workers", "reward/workers": "reward_workers", "env/workers": "env_workers"}
"""Step-metrics key -> status field. A field keeps its last value (the eval accuracy of the last eval)."""


def kv_key(run: str) -> bytes:
    return f"status/{run}".encode()


class RunStatus:
    def __init__(self, run_dir: Path):
        self.path = run_dir / "status.json"
        self.data: dict = {"run": run_dir.name, "state": "running", "started": time.time()}

    def step(self, metrics: dict) -> None:
        self.data.update({field: metrics[key] for key, field in FIELDS.items() if key in metrics})
        self.data["step"] = int(self.data.get("step", 0))
        self._write()

    def finish(self, state: str) -> None:
        """``state``: finished, failed or preempted (SIGTERM)."""
        self.data["state"] = state
        self._write()

    def _write(self) -> None:
        self.data["updated"] = time.time()
        text = json.dumps(self.data)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)
        import ray

        if ray.is_initialized():
            _put(self.data["run"], text)


def announce(run: str, sizes: dict) -> None:
    """A new run named ``run`` starts: its record in the cluster's store says so before anyone can reach its
    controller, so that `fleetrl scale` or `stop` never read the ended record of an earlier run of the same name."""
    _put(run, json.dumps({"run": run, "state": "running", "started": time.time(), **sizes}))


def _put(run: str, text: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(kv_key(run), text.encode(), overwrite=True, namespace=KV_NAMESPACE)


def read_status(run: str) -> dict | None:
    """The run's last status from the connected cluster's key-value store; None when it has none."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(kv_key(run), namespace=KV_NAMESPACE)
    return json.loads(raw) if raw else None
