"""`Fleet.for_command` on a tiny real Ray instance (private, started by the command's own `init_ray` in a process
of its own, as a command's; one reward actor per fleet, ~15 s): a command that starts its fleet stops every actor of
it on exit, error or not; a fleet it was given (a pipeline's, the test suite's fleet server) serves it and is left
running."""

import contextlib
import subprocess
import sys
import time

import pytest

from orchestrator.config import load_config
from orchestrator.rl.fleet import Fleet, Roles
from tests.conftest import subprocess_env
from tests.test_e2e import ROOT


def _gone(handles: list, within_s: float) -> bool:
    """Whether every actor of ``handles`` is dead within ``within_s`` (`ray.kill` returns before the actor is gone:
    a call made just after it may still be answered)."""
    import ray

    deadline, alive = time.monotonic() + within_s, list(handles)
    while True:
        answered = []
        for w in alive:
            with contextlib.suppress(ray.exceptions.RayActorError):
                ray.get(w.ready.remote(), timeout=60)
                answered.append(w)
        alive = answered
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.2)


@pytest.mark.own_fleet
def test_a_command_stops_the_fleet_it_started_and_leaves_a_given_one_up(tmp_path):
    """eval, search, `prm label` and `cai` take their fleet from :meth:`Fleet.for_command`: started by the command,
    its actors are gone when the command ends (and when it fails); given, the same fleet serves it, its groups kept
    (:func:`plan_serve`), and still answers after it. In a process of its own (a private Ray, as a command's)."""
    script = f"from tests.test_fleet_command import scenario; scenario({str(tmp_path)!r}); print('SCENARIO OK')"
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=subprocess_env(RAY_USAGE_STATS_ENABLED="0"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "SCENARIO OK" in r.stdout, (r.stdout + r.stderr)[-4000:]


def scenario(tmp_path: str) -> None:
    """The test's body, in a process whose first `for_command` starts a private Ray."""
    import ray

    cfg = load_config(None, ["reward.num_workers=1", f"run.dir={tmp_path}/eval"])
    roles = Roles(reward=True)
    with Fleet.for_command(None, cfg, roles) as own:
        handles = own.workers()["reward"]
        assert len(handles) == 1 and not _gone(handles, 0)
    assert _gone(handles, 30) and not own.groups()
    with pytest.raises(RuntimeError, match="the command failed"), Fleet.for_command(None, cfg, roles) as own:
        handles = own.workers()["reward"]
        raise RuntimeError("the command failed")
    assert _gone(handles, 30)

    given = Fleet.start(cfg, roles)
    try:
        handles = given.workers()["reward"]
        for run in ("search", "label"):  # the second run asks the kept actors, sends their logs to its run.dir
            other = load_config(None, ["reward.num_workers=1", f"run.dir={tmp_path}/{run}"])
            with Fleet.for_command(given, other, roles) as serving:
                assert serving is given and given.workers()["reward"] == handles
        assert given.kept == ["reward"] and not _gone(handles, 3)  # a stopped actor is gone in well under 1 s
    finally:
        given.stop()
    assert _gone(handles, 30)
    ray.shutdown()
