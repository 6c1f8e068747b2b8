"""`python -m tests.fleet_server`: one process that runs `fleetrl` commands one after another on one fleet, for the
end-to-end tests. The tests would otherwise pay a process start (imports, tokenizer, joining Ray) and a
fleet start-up (vLLM engines, learner ranks, reward actors: 45-60 s on 2 cores) for every run; here each command
is :func:`orchestrator.cli.main.main` with the server's :class:`~orchestrator.rl.fleet.Fleet`, which keeps the actors
that fit the next run (:meth:`~orchestrator.rl.fleet.Fleet.serve`: the learner ranks load the run's model and optimizer,
kept engines get its weights) and starts the rest, exactly as a pipeline's stages share a fleet.

Protocol: one JSON object per line on stdin, ``{"argv": [...], "out": DIR, "env": {...}}`` (``env``, optional:
variables set for this command only, e.g. a test's ``HF_HOME``); the command's standard output and
error (file descriptors 1 and 2, so the actors' and libraries' output too) go to ``DIR/stdout`` and ``DIR/stderr``,
and one line ``{"rc": N}`` answers on the server's own standard output. A command that fails as fleetrl reports
failures (exit 1: a dead learner rank, a failing reward, NaN steps) leaves the fleet up: the next command's
:meth:`~orchestrator.rl.fleet.Fleet.serve` replaces any group with an actor that does not answer. An unforeseen
exception (a traceback) stops the fleet, and the next command starts a new one. End of input stops
the fleet and the process."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path


def run_command(argv: list[str], out: Path, fleet, env: dict | None = None) -> int:
    """One `fleetrl` command on ``fleet`` with its output in ``out`` and ``env`` set meanwhile; its exit status."""
    saved_env = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return _run_command(argv, out, fleet)
    finally:
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _run_command(argv: list[str], out: Path, fleet) -> int:
    from orchestrator.cli.main import main

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out / "stdout", "w") as o, open(out / "stderr", "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            rc = main(argv, fleet=fleet)
        except SystemExit as x:  # argparse
            rc = x.code if isinstance(x.code, int) else 2
        except BaseException:  # what `python -m orchestrator` would print and exit 1 on
            traceback.print_exc()
            fleet.stop()  # an unforeseen failure: the next command starts a new fleet
            rc = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            _reset_logging()
    return rc


def _reset_logging() -> None:
    """A training command sends the root logger to its run's driver.log: the next command starts clean."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()


def main() -> None:
    from orchestrator.config import load_config
    from orchestrator.rl.fleet import Fleet, Roles

    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed between commands must not reach the replies
    fleet = Fleet(load_config(None, []), Roles())  # no actor yet: the first command starts what it uses
    record = os.environ.get("FLEETRL_SERVER_LOG")  # one line per command: where the suite's time goes
    for line in sys.stdin:
        request = json.loads(line)
        t0 = time.perf_counter()
        fleet.startup_s, fleet.kept = None, []
        rc = run_command(request["argv"], Path(request["out"]), fleet, request.get("env"))
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({"argv": request["argv"], "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
                                    "fleet_s": fleet.startup_s and round(fleet.startup_s, 1), "kept": fleet.kept,
                                    "fleet": fleet.describe()}) + "\n")
        reply.write(json.dumps({"rc": rc}) + "\n")
    fleet.stop()


if __name__ == "__main__":
    main()
