"""A real two-node Ray cluster on loopback (`ray start --head` plus a second `ray start --address`, each with its own
resources; token authentication left on, as Ray 2.60 sets it). The embedded job is submitted with `fleetrl submit`,
its rollout pool is scaled 1 -> 2 -> 1 while it runs with `fleetrl scale`, it is stopped gracefully with
`fleetrl stop` and polled to SUCCEEDED with `fleetrl status`, and Ray's Prometheus export is scraped for the
fleetrl_* metrics. Every prompt of every step must have been generated and scored exactly once (checked from the
run's rollout dumps)."""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from orchestrator.config import EMBEDDED_MODEL_PATH
from orchestrator.models.embedded_model import init_model
from orchestrator.telemetry.controller import METRICS as CONTROLLER_METRICS
from rewards.tasks import ArithmeticTask
from tests.conftest import free_ports, node_ports_args, stop_ray_processes, subprocess_env
from tests.test_e2e import ROOT

BIN = Path(sys.executable).parent
METRICS = list(CONTROLLER_METRICS)  # every metric the controller exports must reach Prometheus
MAX_STEPS, PROMPTS, G = 400, 8, 4  # the test ends the run with `fleetrl stop` long before MAX_STEPS


@pytest.fixture
def cluster(tmp_path):
    gcs, dash, *p = free_ports(10)
    # with a token in ~/.ray/auth_token the head turns token auth on; a joining node opts in with RAY_AUTH_MODE=token.
    # The fleetrl commands get no such variable: they must find and send the token themselves.
    env = subprocess_env(RAY_USAGE_STATS_ENABLED="0", PATH=f"{BIN}:{os.environ['PATH']}")
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE"):
        env.pop(key, None)
    node_env = dict(env, RAY_AUTH_MODE="token")
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, capture_output=True, timeout=60)
    ray = str(BIN / "ray")
    temp = Path(f"/tmp/fleetrl-cluster-{os.getpid()}")  # short: Ray's socket paths have a length limit
    head = [ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs), "--dashboard-host",
            "127.0.0.1", "--dashboard-port", str(dash), "--num-cpus", "3", "--resources", '{"learner_node": 2}',
            "--temp-dir", str(temp), *node_ports_args(*p[0:4])]
    worker = [ray, "start", "--address", f"127.0.0.1:{gcs}", "--node-ip-address", "127.0.0.1", "--num-cpus", "3",
              "--resources", '{"rollout_node": 4}', *node_ports_args(*p[4:8])]
    try:
        for cmd in (head, worker):
            subprocess.run(cmd, env=node_env, check=True, capture_output=True, text=True, timeout=120)
        assert _http_status(f"http://127.0.0.1:{dash}/api/jobs/") == 401  # token auth is on
        yield {"gcs": f"127.0.0.1:{gcs}", "jobs": f"http://127.0.0.1:{dash}", "metrics": [p[0], p[4]], "env": env}
    finally:
        stop_ray_processes(gcs, str(temp))
        shutil.rmtree(temp, ignore_errors=True)


def _http_status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


def _fleetrl(env: dict, *args: str, timeout: int = 180) -> str:
    proc = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait_step(run_dir: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step and "reward/mean" in r for r in _rows(run_dir)):
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.5)


def _scrape(ports: list[int]) -> str:
    text = ""
    for port in ports:
        try:
            text += urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        except OSError:
            pass
    return text


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_two_node_cluster_submit_scale_status_metrics(cluster, tmp_path):
    run_dir = tmp_path / "cluster-run"
    env = cluster["env"]
    if not (ROOT / EMBEDDED_MODEL_PATH / "config.json").exists():  # the job gets it by absolute path: build it here
        init_model(ROOT / EMBEDDED_MODEL_PATH)
    out = _fleetrl(env, "submit", "--address", cluster["jobs"], "--python", sys.executable,
                   f"model.path={ROOT / EMBEDDED_MODEL_PATH}", f"run.dir={run_dir}", f"trainer.total_steps={MAX_STEPS}",
                   "trainer.eval_every=10", "data.eval_size=16", f"data.prompts_per_step={PROMPTS}",
                   f"rollout.group_size={G}", "rollout.num_workers=1", "rollout.resources={rollout_node: 1}",
                   "learner.num_ranks=1", "learner.zero_stage=0", "learner.resources={learner_node: 1}",
                   "run.dump_rollouts=true")
    job = out.split()[1]
    assert job.startswith("fleetrl-cluster-run-"), out

    _wait_step(run_dir, 3)
    scale_env = dict(env, RAY_ADDRESS=cluster["gcs"])
    assert json.loads(_fleetrl(scale_env, "scale", "--rollout", "2"))["rollout_workers"] == 2
    grown = max(r["step"] for r in _rows(run_dir))
    _wait_step(run_dir, grown + 3)
    assert json.loads(_fleetrl(scale_env, "scale", "--rollout", "1"))["rollout_workers"] == 1
    shrunk = max(r["step"] for r in _rows(run_dir))
    _wait_step(run_dir, shrunk + 2)

    scraped, deadline = "", time.monotonic() + 90
    while not all(m in scraped for m in METRICS) and time.monotonic() < deadline:
        time.sleep(2)
        scraped = _scrape(cluster["metrics"])
    assert [m for m in METRICS if m not in scraped] == [], [x for x in scraped.splitlines() if "fleetrl" in x]

    stopped = json.loads(_fleetrl(scale_env, "stop", "--run", "cluster-run"))
    assert stopped["stopped"], stopped
    deadline, status = time.monotonic() + 120, {}
    while status.get("status") not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, status
        time.sleep(2)
        status = json.loads(_fleetrl(scale_env, "status", job, "--address", cluster["jobs"], "--json"))
    assert status["status"] == "SUCCEEDED", status
    assert status["run_state"] == "finished" and status["policy_version"] == status["step"], status
    last = status["step"]
    assert shrunk + 2 < last < MAX_STEPS and 0 <= status["eval_accuracy"] <= 1
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == last
    assert (run_dir / "final" / "config.json").exists()

    rows = [r for r in _rows(run_dir) if "reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(last))
    sizes = [r["rollout/workers"] for r in rows]
    assert 2 in sizes and sizes[-1] == 1 and sizes[0] == 1
    _check_exactly_once(run_dir, rows)


def _check_exactly_once(run_dir: Path, rows: list[dict]) -> None:
    """Each step's dump holds every prompt of that step (the pure prompt stream) G times, each (prompt, sample)
    once, each with a reward; while the pool had 2 workers both generated."""
    task, two_worker_steps = ArithmeticTask(), 0
    for r in rows:
        dump = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{r['step']:06d}.jsonl").read_text().splitlines()]
        keys = [(d["uid"], d["j"]) for d in dump]
        expected = {(p.uid, j) for p in task.train_batch(r["step"], PROMPTS) for j in range(G)}
        assert len(keys) == len(set(keys)) == PROMPTS * G and set(keys) == expected
        assert all(isinstance(d["reward"], float) and "math" in d["components"] for d in dump)
        two_worker_steps += len({d["worker"] for d in dump}) == 2
    assert two_worker_steps >= 1


RERUN = """
import json, os, sys
from pathlib import Path
import ray
from orchestrator.telemetry.controller import start_controller
from orchestrator.cli.jobs import scale
from orchestrator.telemetry.run_status import RunStatus

ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)  # the session's head (tests/conftest.py)
Path(sys.argv[1]).mkdir()
old = RunStatus(Path(sys.argv[1]))  # an earlier run of the same name ended at step 7
old.step({"step": 7, "rollout/workers": 2, "reward/workers": 1})
old.finish("finished")
ctl = start_controller(Path(sys.argv[1]).name, 2, 1)  # (held) the new run's controller; no step of it is in yet
try:
    scale(rollout=1, reward=None, run=Path(sys.argv[1]).name, address=None, wait_s=2)
except Exception as e:
    print("RESULT", json.dumps(type(e).__name__ + ": " + str(e)))
"""


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_scale_before_a_reruns_first_step_waits_for_it_not_for_the_earlier_runs_end(tmp_path):
    """A run named like an earlier one (`tmp_path/run` in every test) is scaled before its first step is in: `scale`
    must wait for this run to apply it, not answer from the earlier run's ended record (CI saw "the run ended before
    the resize was applied (last step 7)" from a 4-step run). Joins the shared head; starts no engine."""
    from tests.conftest import shared_ray_env

    env = subprocess_env(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", **shared_ray_env())
    r = subprocess.run([sys.executable, "-c", RERUN, str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-4000:]
    assert json.loads(lines[0][7:]).startswith("TimeoutError: the run did not reach"), lines[0]
