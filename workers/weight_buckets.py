"""Weight buckets: many named tensors packed into one flat byte buffer plus a small index.

A bucket crosses Ray's object store as a numpy uint8 array (pickle protocol 5, zero-copy on the receiving
side) instead of one pickled torch tensor per parameter; the receiver takes views into it. Works for every
dtype (bf16 included) because only bytes travel.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 64


@dataclass
class Bucket:
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]  # torch dtype names, e.g. "float32"
    offsets: list[int]  # byte offset of each tensor in `data`
    data: np.ndarray  # uint8, all tensors' bytes back to back


def pack(named: list[tuple[str, torch.Tensor]]) -> Bucket:
    """Copy the tensors (any device) into one contiguous CPU byte buffer."""
    sizes = [t.numel() * t.element_size() for _, t in named]
    offsets, pos = [], 0
    for size in sizes:
        offsets.append(pos)
        pos += -(-size // ALIGN) * ALIGN  # each tensor starts on an ALIGN-byte boundary
    data = torch.empty(pos, dtype=torch.uint8)
    for (_, t), size, off in zip(named, sizes, offsets):
        data[off: off + size].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu())
    return Bucket(names=[n for n, _ in named], shapes=[tuple(t.shape) for _, t in named],
                  dtypes=[str(t.dtype).removeprefix("torch.") for _, t in named], offsets=offsets,
                  data=data.numpy())


def unpack(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Views into the bucket's buffer (no copy); valid while the bucket is alive. A bucket from Ray's object store
    is read-only shared memory; the views are only read (copied into the engine's parameters), so torch's warning
    about a non-writable array is silenced for exactly this call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        raw = torch.from_numpy(np.asarray(bucket.data))
    out = []
    for name, shape, dtype, off in zip(bucket.names, bucket.shapes, bucket.dtypes, bucket.offsets):
        dt = getattr(torch, dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        out.append((name, raw[off: off + nbytes].view(dt).view(shape)))
    return out
