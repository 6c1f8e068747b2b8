"""The one weight-bucket format, for both pushes (object store and collective) and the learner's checkpoint export.

A bucket is many named tensors packed back to back into one flat uint8 buffer, described by a
:class:`BucketPlan` (names, shapes, dtypes, byte offsets). Plans are computed from the parameters' full shapes
(:func:`param_specs`, ZeRO-3 aware) by :func:`plan_buckets`, a pure function; every rank walks the same plans
(:func:`gathered_buckets`, where the ZeRO-3 gather is collective) and the sender packs each bucket
(:func:`pack_bucket`). Only bytes travel, so every dtype works (bf16 included); the receiver takes views
(:func:`unpack_bucket`).

- Object store (``rollout.weight_sync: object_store``): a bucket crosses as ``(plan, numpy uint8 array)``
  (:func:`to_object` / :func:`from_object`; pickle protocol 5, zero-copy on the receiving side).
- Collective (``workers/nccl_sync.py``): sender and receivers hold the same plans, so only the buffer crosses.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

ALIGN = 256  # every tensor starts on a 256-byte boundary of its bucket (a valid view for any dtype)
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}

TensorSpec = tuple[str, Sequence[int], str]  # (name, shape, torch dtype name such as "bfloat16")


@dataclass(frozen=True)
class BucketPlan:
    """Where each tensor of one bucket sits in the bucket's flat uint8 buffer. Sender and receivers hold the same
    plan, so only the buffer itself crosses the wire."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    offsets: tuple[int, ...]  # byte offset of each tensor
    nbytes: int  # buffer length: the aligned end of the last tensor


def tensor_nbytes(name: str, shape: Sequence[int], dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{name}: unsupported dtype {dtype!r}; supported: {sorted(DTYPE_BYTES)}")
    if any(int(d) < 0 for d in shape):
        raise ValueError(f"{name}: negative dimension in shape {tuple(shape)}")
    return math.prod(int(d) for d in shape) * DTYPE_BYTES[dtype]


def plan_buckets(specs: Sequence[TensorSpec], cap_bytes: int) -> list[BucketPlan]:
    """Group tensors, in the given order, into consecutive buckets of at most ``cap_bytes`` (offsets aligned to
    :data:`ALIGN`). A tensor larger than the cap gets a bucket of its own. Pure: no torch, no devices."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    seen: set[str] = set()
    buckets: list[BucketPlan] = []
    current: list[tuple[str, tuple[int, ...], str, int]] = []  # (name, shape, dtype, offset)
    end = 0
    for name, shape, dtype in specs:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the weight specs")
        seen.add(name)
        size = tensor_nbytes(name, shape, dtype)
        offset = -(-end // ALIGN) * ALIGN
        if current and offset + size > cap_bytes:
            buckets.append(_bucket(current, end))
            current, offset = [], 0
        current.append((name, tuple(int(d) for d in shape), dtype, offset))
        end = offset + size
    if current:
        buckets.append(_bucket(current, end))
    return buckets


def _bucket(entries: list[tuple[str, tuple[int, ...], str, int]], end: int) -> BucketPlan:
    names, shapes, dtypes, offsets = zip(*entries)
    return BucketPlan(names, shapes, dtypes, offsets, -(-end // ALIGN) * ALIGN)


def param_specs(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """Specs of a model's parameters (``module.named_parameters()``: tied weights appear once). Under ZeRO-3 a
    parameter's local tensor is an empty shard; its full shape is ``ds_shape``."""
    return [(name, tuple(getattr(p, "ds_shape", p.shape)), str(p.dtype).removeprefix("torch."))
            for name, p in named_params]


FLOATS = ("float64", "float32", "bfloat16", "float16")
"""The dtypes a push may narrow (:func:`narrowed_specs`)."""


def narrowed_specs(specs: Sequence[TensorSpec], dtype: str | None) -> list[TensorSpec]:
    """``specs`` with every floating matrix wider than ``dtype`` planned as ``dtype`` (a push to engines serving
    ``dtype``: an fp32 learner sends bf16 matrices, half the bytes, rounded to nearest here; the engine would round
    them on load anyway, vLLM's reload not always to nearest: within one bf16 step of it). Vectors (biases, norms)
    keep their dtype: a CPU engine may hold them in fp32, and they are a sliver of the bytes. None, or a wider
    ``dtype``: unchanged."""
    if dtype is None:
        return list(specs)
    return [(name, shape, dtype if src in FLOATS and len(shape) >= 2 and DTYPE_BYTES[src] > DTYPE_BYTES[dtype]
             else src) for name, shape, src in specs]


def as_planned(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """``t`` in its planned dtype (a narrowed push rounds to nearest here)."""
    return t if str(t.dtype).removeprefix("torch.") == dtype else t.to(getattr(torch, dtype))


def pack_bucket(plan: BucketPlan, tensors: Sequence[torch.Tensor], device: torch.device | str = "cpu"
                ) -> torch.Tensor:
    """Copy the bucket's tensors (full, not ZeRO-3 shards: gather first) into one new uint8 buffer on ``device``,
    each in its planned dtype (a floating tensor planned narrower is rounded, :func:`narrowed_specs`)."""
    buf = torch.zeros(plan.nbytes, dtype=torch.uint8, device=device)
    for name, shape, dtype, off, t in zip(plan.names, plan.shapes, plan.dtypes, plan.offsets, tensors, strict=True):
        src = str(t.dtype).removeprefix("torch.")
        if tuple(t.shape) != shape or (src != dtype and not (src in FLOATS and dtype in FLOATS)):
            raise ValueError(f"{name}: planned {dtype}{list(shape)}, got {t.dtype}{list(t.shape)} (a ZeRO-3 "
                             "parameter must be gathered before packing)")
        t = as_planned(t.detach(), dtype)
        nbytes = t.numel() * t.element_size()
        buf[off: off + nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
    return buf


def unpack_bucket(plan: BucketPlan, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Named views into ``buf`` (no copy; valid while ``buf`` is alive)."""
    out = []
    for name, shape, dtype, off in zip(plan.names, plan.shapes, plan.dtypes, plan.offsets):
        nbytes = tensor_nbytes(name, shape, dtype)
        out.append((name, buf[off: off + nbytes].view(getattr(torch, dtype)).view(shape)))
    return out


def gathered_buckets(plans: Sequence[BucketPlan], params: Mapping[str, torch.Tensor],
                     gather: Callable[[list[torch.Tensor]], contextlib.AbstractContextManager] | None = None
                     ) -> Iterator[tuple[BucketPlan, list[torch.Tensor]]]:
    """``(plan, the bucket's full tensors)`` per bucket, each yielded inside ``gather(tensors)`` (the ZeRO-3
    context that materializes shards, ``deepspeed.zero.GatheredParameters(ps, modifier_rank=None)``): every rank
    must walk all of it, and use the tensors before asking for the next bucket."""
    for plan in plans:
        chunk = [params[name] for name in plan.names]
        with gather(chunk) if gather is not None else contextlib.nullcontext():
            yield plan, chunk


def to_object(plan: BucketPlan, tensors: Sequence[torch.Tensor]) -> tuple[BucketPlan, object]:
    """A bucket for Ray's object store: its plan and its bytes as a numpy array."""
    return plan, pack_bucket(plan, tensors).numpy()


def from_object(bucket: tuple[BucketPlan, object]) -> list[tuple[str, torch.Tensor]]:
    """Views into an object-store bucket (no copy). Its array is read-only shared memory; the views are only read
    (copied into the engine's parameters), so torch's non-writable warning is silenced for exactly this call."""
    import numpy as np

    plan, data = bucket
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        buf = torch.from_numpy(np.asarray(data))
    return unpack_bucket(plan, buf)
