"""The run's control point on the cluster: a small named actor, ``fleetrl-controller-<run>`` in the Ray namespace
``fleetrl``.

- **Live scaling.** ``fleetrl scale --rollout N --reward M`` (or any Ray client) calls :meth:`FleetController.scale`;
  the driver reads :meth:`FleetController.desired` at every step boundary and resizes its pools there, so a step's
  batch is never split across a resize.
- **Ray metrics.** The driver reports each step's metrics; the controller exports them with ``ray.util.metrics``
  (``fleetrl_*``), so they show in the Ray dashboard's metrics view and on Ray's Prometheus endpoint (which
  prefixes application metrics with ``ray_``).
- **Graceful stop.** ``fleetrl stop`` calls :meth:`FleetController.request_stop`; the driver finishes the step it
  is in, evaluates, writes the final policy and exits 0.
- **Status** is not kept here: ``fleetrl status``, ``scale`` and ``stop`` read the driver's status record
  (:mod:`orchestrator.telemetry.run_status`), which outlives the run.
"""

from __future__ import annotations

import time

NAMESPACE = "fleetrl"
STEP_SECONDS_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]

# metric name -> (kind, description, step-metrics key it reads)
METRICS = {
    "fleetrl_step": ("gauge", "Last completed training step.", "step"),
    "fleetrl_reward_mean": ("gauge", "Mean reward of the last step's samples.", "reward/mean"),
    "fleetrl_eval_accuracy": ("gauge", "Last held-out greedy accuracy.", "eval/accuracy"),
    "fleetrl_step_seconds": ("histogram", "Wall-clock seconds per training step.", "time/step_s"),
    "fleetrl_generated_tokens_total": ("counter", "Completion tokens generated for training.", "tokens_generated"),
    "fleetrl_tokens_per_second": ("gauge", "Generated tokens per second of step time.", "throughput/tokens_per_s"),
    "fleetrl_policy_version": ("gauge", "Policy version of the weights in the engines.", "policy_version"),
    "fleetrl_weight_sync_seconds": ("gauge", "Seconds of the last learner -> engines weight push.", "time/sync_s"),
    "fleetrl_rollout_workers": ("gauge", "Live rollout actors.", "rollout/workers"),
    "fleetrl_reward_workers": ("gauge", "Live reward actors.", "reward/workers"),
    # a Ray Counter cannot be incremented by 0, so it would not exist before the first error: a gauge holding the
    # running total is exported from the first step (rate() works the same on it)
    "fleetrl_reward_errors_total": ("total", "Reward-function calls that raised or timed out (running total).",
                                    "reward/errors"),
    "fleetrl_rollout_queue_depth": ("gauge", "Prompts queued or in flight at the rollout actors at the end of the "
                                    "step (one_step_off: the next batch).", "rollout/queue_depth"),
}


def controller_name(run: str) -> str:
    return f"fleetrl-controller-{run}"


class FleetController:
    """Plain class; :func:`start_controller` wraps it with ``ray.remote`` (detached from nothing: it dies with the
    job's driver)."""

    def __init__(self, run: str, rollout_workers: int, reward_workers: int, env_workers: int = 0):
        self.run = run
        self._desired = {"rollout": rollout_workers, "reward": reward_workers, "env": env_workers}
        self._stop = False
        self._metrics = _make_metrics(run)
        self._totals: dict[str, float] = {}

    def scale(self, rollout: int | None = None, reward: int | None = None, env: int | None = None) -> dict:
        """Request new pool sizes; the driver applies them at the next step boundary."""
        if env is not None and not self._desired["env"]:
            raise ValueError("--env: this run keeps its environments inside the rollout actors (env.num_workers "
                             "is 0); start it with env.num_workers >= 1 to scale them")
        for role, n in (("rollout", rollout), ("reward", reward), ("env", env)):
            if n is not None:
                if not isinstance(n, int) or n < 1:
                    raise ValueError(f"--{role} must be an integer >= 1, got {n!r}")
                self._desired[role] = n
        return dict(self._desired)

    def run_name(self) -> str:
        return self.run

    def desired(self) -> dict:
        return {**self._desired, "stop": self._stop}

    def request_stop(self) -> dict:
        """Ask for a graceful stop: the driver ends at the next step boundary with a final eval, the final policy
        and the summary, and the job ends SUCCEEDED (``ray job stop`` kills it instead)."""
        self._stop = True
        return self.desired()

    def report(self, metrics: dict) -> None:
        """One step's metrics from the driver: export the fleetrl_* metrics (the run's status record is the
        driver's, :mod:`orchestrator.telemetry.run_status`)."""
        for name, (kind, _, key) in METRICS.items():
            value = metrics.get(key)
            if value is None:
                continue
            m = self._metrics[name]
            if kind == "gauge":
                m.set(float(value))
            elif kind == "counter":
                if value > 0:
                    m.inc(float(value))
            elif kind == "total":
                self._totals[name] = self._totals.get(name, 0.0) + float(value)
                m.set(self._totals[name])
            else:
                m.observe(float(value))


def _make_metrics(run: str) -> dict:
    from ray.util import metrics as rm

    out = {}
    for name, (kind, desc, _) in METRICS.items():
        if kind in ("gauge", "total"):
            out[name] = rm.Gauge(name, description=desc, tag_keys=("run",))
        elif kind == "counter":
            out[name] = rm.Counter(name, description=desc, tag_keys=("run",))
        else:
            out[name] = rm.Histogram(name, description=desc, boundaries=STEP_SECONDS_BUCKETS, tag_keys=("run",))
        out[name].set_default_tags({"run": run})
    return out


def start_controller(run: str, rollout_workers: int, reward_workers: int, env_workers: int = 0):
    """Start the run's controller actor (a stale one of a finished run with the same name is replaced, and so is
    that run's status record)."""
    import contextlib

    import ray

    from orchestrator.telemetry.run_status import announce

    announce(run, {"rollout_workers": rollout_workers, "reward_workers": reward_workers, "env_workers": env_workers})
    name = controller_name(run)
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        time.sleep(0.5)  # let the name be released
    actor = ray.remote(FleetController).options(name=name, namespace=NAMESPACE, num_cpus=0, max_restarts=0)
    handle = actor.remote(run, rollout_workers, reward_workers, env_workers)
    ray.get(handle.desired.remote())
    return handle


def find_controllers() -> list[str]:
    """Names of the fleetrl controllers alive on the connected cluster."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith("fleetrl-controller-"))


def get_controller(run: str | None):
    """The controller of ``run`` (its run-dir name), or the only one alive when ``run`` is None."""
    import ray

    if run is None:
        names = find_controllers()
        if len(names) != 1:
            raise LookupError(f"{len(names)} fleetrl runs are live on this cluster ({names or 'none'}); "
                              "name one with --run")
        return ray.get_actor(names[0], namespace=NAMESPACE)
    try:
        return ray.get_actor(controller_name(run), namespace=NAMESPACE)
    except ValueError:
        raise LookupError(f"no live fleetrl run named {run!r} on this cluster; live: {find_controllers()}") from None
