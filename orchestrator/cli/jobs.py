"""Ray cluster operations: submit a training run as a Ray job, show its status, scale its pools while it runs.

Token authentication (on by default for clusters started by Ray 2.60 when a token exists) stays on: the job
SDK calls send ``Authorization: Bearer <token>`` with the token Ray itself would use (``RAY_AUTH_TOKEN``, else the
file named by ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``), and ``fleetrl scale`` joins the cluster in
token mode when a token exists (Ray's client only does that by itself for ``address="auto"``). The documented
plain form works the same: ``ray job submit --working-dir . -- python -m orchestrator train -c cfg.yaml``.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from orchestrator.config import ConfigError, load_config

# never uploaded with the working dir (Ray also skips what .gitignore lists)
EXCLUDES = ["runs/", ".venv/", ".git/", "**/checkpoints/", "**/__pycache__/", "bench/results/", "*.safetensors"]


def auth_token() -> str | None:
    """The Ray auth token, looked up in Ray's order; None when there is none (a cluster without token auth)."""
    import os

    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip() if path.is_file() else None


def job_client(address: str | None):
    """A job SDK client for the dashboard at ``address`` that sends the auth token when there is one."""
    import os

    from ray.job_submission import JobSubmissionClient

    token, url = auth_token(), job_address(address)
    reachable(url, "the job API")
    # Ray's client lets RAY_ADDRESS override the address it is given; on a cluster node that is usually the GCS
    # address, which is not the job API. RAY_API_SERVER_ADDRESS takes precedence over it: pin it to ours.
    before = os.environ.get("RAY_API_SERVER_ADDRESS")
    os.environ["RAY_API_SERVER_ADDRESS"] = url
    try:
        return JobSubmissionClient(url, headers={"Authorization": f"Bearer {token}"} if token else None)
    finally:
        if before is None:
            del os.environ["RAY_API_SERVER_ADDRESS"]
        else:
            os.environ["RAY_API_SERVER_ADDRESS"] = before


JOB_API_PORT, GCS_PORT = 8265, 6379
"""Ray's default ports of a head node's job API (dashboard) and GCS: what one address is derived from the other by."""


def job_address(address: str | None) -> str:
    """The job API (dashboard) address: --address (the job API ``http://HOST:8265``; a GCS address ``HOST:PORT``
    gives ``http://HOST:8265``), else RAY_ADDRESS when it is an http URL; with neither a LookupError says what to
    give (no default cluster)."""
    import os

    env = os.environ.get("RAY_ADDRESS", "")
    found = address or (env if env.startswith("http") else None)
    if found is None:
        raise LookupError("give the cluster's job API with --address http://HOST:8265 or RAY_ADDRESS=http://HOST:8265 "
                          "(fleetrl does not pick a cluster for you)")
    return found if "://" in found else f"http://{_host(found)}:{JOB_API_PORT}"


def gcs_address(address: str | None) -> str | None:
    """The GCS address a Ray client joins: --address when it is one (``HOST:PORT``), else RAY_ADDRESS when it is
    one, else ``HOST:6379`` of the job API URL in --address or RAY_ADDRESS; None with neither (never a Ray instance
    found on this machine)."""
    import os

    env = os.environ.get("RAY_ADDRESS", "")
    if address and "://" not in address:
        return address
    if env and "://" not in env:
        return env
    named = address or env
    return f"{_host(named)}:{GCS_PORT}" if named else None


def _host(address: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(address if "://" in address else f"tcp://{address}").hostname or address


def submit(config: str | None, overrides: list[str], address: str | None, python: str = "python",
           env: dict[str, str] | None = None) -> str:
    """Validate the config here (nothing is submitted when it is bad), then submit the driver as a Ray job with
    the current directory as its working dir. A recipe (a YAML with ``stages``) runs as `fleetrl pipeline`, every
    stage of it checked first. Returns the job id."""
    from orchestrator.recipes.pipeline import check_inputs, is_recipe, load_recipe

    command = "pipeline" if config is not None and is_recipe(config) else "train"
    if command == "pipeline":
        stages = load_recipe(config, overrides)
        check_inputs(stages)
        cfg = stages[0].cfg
    else:
        cfg = load_config(config, overrides)
    if config is not None:
        rel = Path(config).resolve()
        if not rel.is_relative_to(Path.cwd()):
            raise ConfigError(f"config file {config} must be inside the working directory {Path.cwd()} (it is "
                              "uploaded with it); copy it there or pass its settings as overrides")
        config = str(rel.relative_to(Path.cwd()))
    run = Path(cfg.run.dir).name if command == "train" else Path(cfg.run.dir).parent.name
    args = ["-m", "orchestrator", command, *(["-c", config] if config else []), *overrides]
    entrypoint = " ".join(shlex.quote(a) for a in [python, *args])
    return job_client(address).submit_job(
        entrypoint=entrypoint, submission_id=f"fleetrl-{run}-{time.strftime('%Y%m%d-%H%M%S')}",
        runtime_env={"working_dir": ".", "excludes": EXCLUDES,
                     "env_vars": {"TOKENIZERS_PARALLELISM": "false", **(env or {})}},
        metadata={"fleetrl_run": run, "fleetrl_config": config or ""},
    )


def latest_job(client) -> str:
    jobs = [j for j in client.list_jobs() if (j.submission_id or "").startswith("fleetrl-")]
    if not jobs:
        raise LookupError("no fleetrl job on this cluster (submit one with `fleetrl submit`)")
    return max(jobs, key=lambda j: j.start_time or 0).submission_id


def job_status(job_id: str | None, address: str | None) -> dict:
    """The job's state (from the job API at ``address``) and its run's latest numbers, as the driver stated them
    (:mod:`orchestrator.telemetry.run_status`, read from the cluster's key-value store: this joins the cluster as a Ray
    client at :func:`gcs_address`, as `fleetrl scale` does; without it the numbers are left out, with a note)."""
    _token_mode()  # before job_client imports ray
    client = job_client(address)
    job_id = job_id or latest_job(client)
    info = client.get_job_info(job_id)
    out = {"job": job_id, "status": str(info.status.value if hasattr(info.status, "value") else info.status),
           "message": info.message or ""}
    run = (info.metadata or {}).get("fleetrl_run")
    if run:
        from orchestrator.telemetry.run_status import read_status

        try:
            _connect(address)
        except LookupError as e:
            out["note"] = f"the run's numbers need the cluster: {e}"
            return out
        found = read_status(run)
        if found:
            out.update({k: v for k, v in found.items() if k not in ("run", "started")})
            out["run_state"] = out.pop("state")
    return out


def format_status(s: dict) -> str:
    parts = [f"{s['job']}: {s['status']}"]
    if "step" not in s:
        parts.append("(no training step yet)")
    labels = [("step", "step {}"), ("reward", "reward {:.3f}"), ("train_accuracy", "train acc {:.3f}"),
              ("eval_accuracy", "eval acc {:.3f}"), ("tokens_per_second", "{:.0f} tok/s"),
              ("step_seconds", "{:.2f} s/step")]
    parts += [fmt.format(s[k]) for k, fmt in labels if k in s]
    return "  ".join(parts + ([s["message"]] if s.get("message") else []))


def scale(rollout: int | None, reward: int | None, run: str | None, address: str | None, wait_s: float,
          env: int | None = None) -> dict:
    """Ask a running job's controller for new pool sizes; with ``wait_s`` > 0, wait until the driver applied them.
    Connects to the cluster as a Ray client (run it on a cluster node, or through `ray job submit`)."""
    if rollout is None and reward is None and env is None:
        raise ValueError("give --rollout N, --reward M and/or --env K")
    bad = {k: v for k, v in (("--rollout", rollout), ("--reward", reward), ("--env", env)) if v is not None and v < 1}
    if bad:
        raise ValueError(f"{', '.join(f'{k} {v}' for k, v in bad.items())}: a pool needs at least 1 actor")
    ctl, name = _controller(run, address)
    desired = _call(ctl.scale, rollout=rollout, reward=reward, env=env)
    status, ended = _poll(name, lambda s: _applied(s, desired), wait_s,
                          f"the run did not reach {desired} (it applies a resize at the next step boundary)")
    if ended and not _applied(status, desired):
        raise LookupError(f"the run ended before the resize was applied (last step {status.get('step')})")
    return {"desired": desired, "rollout_workers": status.get("rollout_workers"),
            "reward_workers": status.get("reward_workers"), "env_workers": status.get("env_workers"),
            "step": status.get("step")}


def stop(run: str | None, address: str | None, wait_s: float) -> dict:
    """Graceful stop: the driver ends at the next step boundary (final eval, final policy, summary) and the job
    ends SUCCEEDED. With ``wait_s`` > 0, wait until the run has ended (its controller is gone)."""
    ctl, name = _controller(run, address)
    _call(ctl.request_stop)
    status, ended = _poll(name, lambda s: False, wait_s,
                          "the run did not end (it stops at the next step boundary, after a final eval)")
    return {"stopped": ended, "step": status.get("step")}


def _token_mode() -> None:
    """Join in token mode when a token exists; Ray reads this when it is first imported, so call it before that."""
    import os

    if auth_token() and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"


def _connect(address: str | None) -> None:
    """Join the cluster as a Ray client at :func:`gcs_address`. Never a Ray instance found on this machine: with no
    address, a LookupError says what to give."""
    _token_mode()
    import ray

    if ray.is_initialized():
        return
    gcs = gcs_address(address)
    if gcs is None:
        raise LookupError("give the cluster with --address http://HOST:8265 (its GCS is then HOST:6379), a GCS "
                          "address HOST:PORT, or RAY_ADDRESS (fleetrl does not attach to a Ray instance it finds on "
                          "this machine: it may be another user's)")
    reachable(gcs, "the Ray cluster (GCS)")
    ray.init(address=gcs, logging_level="ERROR", log_to_driver=False)


def reachable(address: str, what: str, timeout_s: float = 5.0) -> None:
    """A TCP connection to ``address`` (``host:port`` or an http URL) opens within ``timeout_s``; else a
    LookupError naming it (Ray's own clients retry an unreachable address for minutes)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise LookupError(f"{address!r} is not an address (give HOST:PORT or http://HOST:PORT)") from None
    if not host:
        raise LookupError(f"{address!r} is not an address (give HOST:PORT or http://HOST:PORT)")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise LookupError(f"cannot reach {what} at {address} ({e.strerror or type(e).__name__}, "
                          f"{timeout_s:.0f} s)") from None


def _controller(run: str | None, address: str | None):
    """The run's controller actor and the run's name."""
    from orchestrator.telemetry.controller import get_controller

    _connect(address)
    handle = get_controller(run)
    return handle, run or _call(handle.run_name)


def _call(method, **kwargs):
    """A controller call; the controller dies with its run, which surfaces as LookupError."""
    import ray

    try:
        return ray.get(method.remote(**kwargs))
    except ray.exceptions.RayActorError:
        raise LookupError("the run ended (its controller is gone)") from None


def _poll(run: str, done, wait_s: float, what: str) -> tuple[dict, bool]:
    """Re-read the run's status record (:mod:`orchestrator.telemetry.run_status`) every 0.5 s until ``done(status)``
    or the run ended, for at most ``wait_s`` (then TimeoutError naming ``what``). Returns the last status and
    whether the run has ended."""
    from orchestrator.telemetry.run_status import read_status

    deadline = time.monotonic() + wait_s
    status = read_status(run) or {}
    while wait_s > 0 and not done(status) and status.get("state", "running") == "running":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {wait_s:.0f}s; now: step {status.get('step')}, "
                               f"{status.get('rollout_workers')} rollout, {status.get('reward_workers')} reward")
        time.sleep(0.5)
        status = read_status(run) or {}
    return status, status.get("state", "running") != "running"


def _applied(status: dict, desired: dict) -> bool:
    return status.get("rollout_workers") == desired["rollout"] and status.get("reward_workers") == desired["reward"] \
        and (not desired.get("env") or status.get("env_workers") == desired["env"])
