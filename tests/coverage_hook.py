"""`make coverage`: measure every Python process the suite starts, Ray actors included.

The target puts a one-line ``.pth`` file in the venv that runs this file in every interpreter that starts with
``COVERAGE_PROCESS_START`` set (pytest, the `fleetrl` CLI subprocesses, the Ray head's workers, which inherit the
head's environment). Two things coverage.py does not do by itself for Ray actors:

- a threaded actor's methods run on threads Ray's C++ core starts, which Python's ``threading.settrace`` never
  sees: the actor-method wrapper starts a tracer on such a thread the first time it runs a method there;
- an actor of a finished job is killed without running ``atexit`` (vLLM engine actors are, every time): a daemon
  thread saves the data every few seconds, so a killed actor loses at most its last interval.
"""

import os
import sys
import threading
import time


def _trace_ray_threads(collector) -> None:
    from ray._private.function_manager import FunctionActorManager

    make = FunctionActorManager._make_actor_method_executor

    def make_traced(self, method_name, method):
        run = make(self, method_name, method)

        def traced(*args, **kwargs):
            if sys.gettrace() is None:
                collector._start_tracer()
            return run(*args, **kwargs)

        traced.name, traced.method = run.name, run.method
        return traced

    FunctionActorManager._make_actor_method_executor = make_traced


def _save_now_and_then(cov) -> None:
    while True:
        time.sleep(float(os.environ.get("FLEETRL_COVERAGE_SAVE_S", "5")))
        try:
            cov.save()
        except Exception:  # noqa: BLE001 - retried next time; measuring must never break the run
            pass


def _start() -> None:
    import coverage

    # coverage.py >= 7.10 installs its own `a1_coverage.pth`, which sorts before this hook's and has started
    # measuring already: process_startup() then returns None, and the running instance is the one to extend
    cov = coverage.process_startup() or coverage.Coverage.current()
    if cov is None or getattr(cov, "_fleetrl_hooked", False):
        return
    cov._fleetrl_hooked = True
    # one save at a time: coverage's own exit handlers (atexit, SIGTERM, os._exit) call cov.save() too, and two
    # concurrent writes of one data file can fail or lose the last data
    lock, save = threading.Lock(), cov.save

    def locked_save() -> None:
        with lock:
            save()

    cov.save = locked_save
    if sys.argv and sys.argv[0].endswith("default_worker.py"):
        _trace_ray_threads(cov._collector)
    threading.Thread(target=_save_now_and_then, args=(cov,), name="coverage-save", daemon=True).start()


if os.environ.get("COVERAGE_PROCESS_START"):
    _start()
