"""Start-up cost of optional modules that libraries import only because they are installed.

transformers imports scikit-learn (for assisted generation) as soon as a tokenizer or model class is imported, and
DeepSpeed imports MLflow (for its autotuner): about 2.5 s and 2.6 s of every process's start-up on 2 cores (AMD
EPYC, AVX2). fleetrl's learner ranks, engines and model actors never use either, and the driver does not need
scikit-learn while it imports transformers. A None entry in ``sys.modules`` makes ``import`` raise ImportError,
which both libraries take as "not installed".
"""

from __future__ import annotations

import os
import sys

UNUSED_IN_MODEL_ACTORS = ("sklearn", "mlflow")


def skip_unused_imports() -> None:
    """Call first in a model-hosting actor's constructor (not in reward actors: user reward code may need them)."""
    for name in UNUSED_IN_MODEL_ACTORS:
        sys.modules.setdefault(name, None)


def import_transformers() -> None:
    """Import transformers without its scikit-learn hook (the driver: it may use scikit-learn later itself, which
    then imports normally)."""
    if "transformers" in sys.modules or "sklearn" in sys.modules:
        return
    sys.modules["sklearn"] = None
    try:
        import transformers.generation.candidate_generator  # noqa: F401  (pulled in by AutoTokenizer and models)
    finally:
        del sys.modules["sklearn"]


def pin_build_tools() -> None:
    """Put this interpreter's bin directory first on PATH, so the ninja that torch's JIT build runs is the venv's.

    DeepSpeed compiles its CPU comm op on first use (about 60 s on 2 cores) and ninja decides whether the cached
    build is current. The venv's ninja (1.13, a DeepSpeed dependency) and a system one (1.11 here) hash the build
    commands differently, so runs launched with the venv's bin on PATH and runs without it rebuilt the op each
    time they alternated (16 rebuilds in one day on this machine). Call before importing deepspeed."""
    bin_dir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bin_dir, "ninja")):
        parts = os.environ.get("PATH", "").split(os.pathsep)
        os.environ["PATH"] = os.pathsep.join([bin_dir, *(p for p in parts if p != bin_dir)])
