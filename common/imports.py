"""Start-up cost of optional modules that libraries import only because they are installed, and of a DeepSpeed op
fleetrl never calls.

transformers imports scikit-learn (for assisted generation) as soon as a tokenizer or model class is imported, and
DeepSpeed imports MLflow (for its autotuner): about 2.5 s and 2.6 s of every process's start-up on 2 cores (AMD
EPYC, AVX2). fleetrl's learner ranks, engines and model actors never use either, and the driver does not need
scikit-learn while it imports transformers. A None entry in ``sys.modules`` makes ``import`` raise ImportError,
which both libraries take as "not installed".
"""

from __future__ import annotations

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


def skip_unused_comm_op() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce op (``deepspeed_shm_comm``) when its comm
    backend starts. On a fresh machine that JIT build took 94 s (2 cores, AMD EPYC AVX2), paid by a new user's
    first run and by every clean-clone CI run; later ranks load the cached build. The op serves only DeepSpeed's
    inference/tensor-parallel all-reduce (``inference_all_reduce``); ZeRO's collectives go through
    torch.distributed (gloo here). DeepSpeed skips an op its probe marks incompatible. Call after importing
    deepspeed, before ``deepspeed.init_distributed``, on CPU."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
