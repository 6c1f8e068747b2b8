"""Collective weight push: learner rank 0 broadcasts the policy straight into every engine's workers, in buckets.

The default push (``workers/weight_buckets.py``) goes through Ray's object store: learner rank 0 copies the
weights to CPU, ``ray.put``s them, and every engine fetches them. On a GPU cluster that is one device-to-host
copy, one object-store transfer per engine and one host-to-device copy per engine for every step. This module
is the direct path, a collective broadcast from the trainer into the engines, as OpenRLHF and verl do it for
separate trainer and engine GPUs. The group is built the way vLLM's ``examples/offline_inference/rlhf_utils.py``,
TRL's ``vllm_client`` and vLLM's ``vllm.distributed.weight_transfer.nccl_engine`` build theirs: learner rank 0
and every worker of every engine join a vLLM ``StatelessProcessGroup`` (a ``TCPStore`` rendezvous that leaves
``torch.distributed``'s global group alone: the learner ranks already have theirs, and so do the engines'
tensor-parallel workers) carrying a ``PyNcclCommunicator``, and rank 0 broadcasts.

Group layout (one group for the whole run)::

    rank 0                       learner rank 0 (the sender; it binds the rendezvous socket)
    rank 1 + e * W + r           worker r of engine e, W = workers per engine (tensor x pipeline parallel)

Per push, with ``plans = plan_buckets(param_specs(...), cap)`` (the one bucket format,
:mod:`workers.weight_buckets`, shared with the object-store push) computed once by the driver (names, shapes and
dtypes do not change during a run):

- every learner rank calls :func:`broadcast_weights` (under ZeRO-3 the gather of a bucket's shards is
  collective); rank 0 packs each bucket into one contiguous uint8 buffer and broadcasts it: one NCCL call per
  bucket of at most ``rollout.weight_bucket_mb``;
- at the same time every engine runs ``llm.collective_rpc("fleetrl_receive_weights", args=(plans,))``: each
  worker receives the buckets into fresh buffers and streams views of them into vLLM's in-place, layer-wise
  ``reload_weights`` (the same reload as the object-store path in ``workers/vllm_ext.py``).

Backends: ``nccl`` (GPU; vLLM's ``PyNcclCommunicator``) and ``gloo`` (CPU engines; a stateless torch gloo group).
Only ``gloo`` runs on this project's CPU machine (``rollout.weight_sync=collective`` in ``tests/test_e2e.py``
pushes weights into a real vLLM CPU engine with it); the ``nccl`` branch differs only in
:func:`weight_communicator` and is untested here.

vLLM and ``torch.distributed`` are imported inside functions, so this module imports without them.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from workers.vllm_ext import WeightSyncExtension
from workers.weight_buckets import BucketPlan, gathered_buckets, pack_bucket, unpack_bucket

BACKENDS = ("nccl", "gloo")


def engine_rank_offset(engine_index: int, workers_per_engine: int) -> int:
    """Group rank of worker 0 of engine ``engine_index`` (rank 0 is the learner)."""
    return 1 + engine_index * workers_per_engine


def group_world_size(num_engines: int, workers_per_engine: int) -> int:
    return 1 + num_engines * workers_per_engine


# ---- communicators --------------------------------------------------------------------------------------------
def open_endpoint(host: str | None = None) -> tuple[str, int, socket.socket]:
    """Rank 0 binds the rendezvous socket before anyone connects (no race for a "free" port). Returns
    ``(host, port, listening socket)``; ``host`` defaults to this node's Ray IP."""
    if host is None:
        import ray

        host = ray.util.get_node_ip_address()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return host, sock.getsockname()[1], sock


class _GlooBroadcast:
    """A stateless gloo group with PyNcclCommunicator's ``broadcast(tensor, src)`` signature."""

    def __init__(self, pg):
        self.pg = pg

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.pg.broadcast(tensor, src).wait()


def weight_communicator(backend: str, host: str, port: int, rank: int, world_size: int,
                        device: torch.device | int | str, listen_socket: socket.socket | None = None,
                        timeout_s: float | None = None):
    """Join the weight group. Every rank calls this at about the same time (it is a rendezvous); rank 0 passes
    the socket from :func:`open_endpoint`. ``timeout_s`` (gloo): the longest the rendezvous or one broadcast
    waits for a peer before it raises (``rollout.weight_sync_timeout_s``; None: torch's default, 30 min)."""
    if backend not in BACKENDS:
        raise ValueError(f"weight sync backend {backend!r}: expected one of {BACKENDS}")
    sock = {"listen_socket": listen_socket} if listen_socket is not None else {}
    if backend == "gloo":
        from datetime import timedelta

        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        return _GlooBroadcast(stateless_init_torch_distributed_process_group(host, port, rank, world_size, "gloo",
                                                                             timeout=timeout, **sock))
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size, **sock)
    with _unpinned_nccl_env():
        comm = PyNcclCommunicator(group, device=device)
    if comm.disabled:
        raise RuntimeError(f"NCCL weight group (rank {rank} of {world_size}) is disabled: no CUDA NCCL library, "
                           "a world of 1, or VLLM_DISABLE_PYNCCL is set")
    return comm


def _unpinned_nccl_env():
    """Recent vLLM (0.32 here) pins NCCL_* variables for its own communicators; one shared with the learner must
    be created without those pins, as vLLM's own weight_transfer engine does. Older vLLM has no pins."""
    try:
        from vllm.utils.nccl import unpinned_nccl_env
    except ImportError:
        return contextlib.nullcontext()
    return unpinned_nccl_env()


# ---- learner side ---------------------------------------------------------------------------------------------
def broadcast_weights(comm, plans: Sequence[BucketPlan], params: Mapping[str, torch.Tensor],
                      gather: Callable[[list[torch.Tensor]], contextlib.AbstractContextManager] | None = None) -> int:
    """Called by every learner rank with the same plans. ``gather(params)`` is the ZeRO-3 context that
    materializes a bucket's parameters (``deepspeed.zero.GatheredParameters(ps, modifier_rank=None)``, entered
    by all ranks); ``comm`` is the weight group on rank 0 and None elsewhere. Buckets are packed on the
    communicator's device (NCCL: rank 0's GPU). Returns the bytes rank 0 sent."""
    device = getattr(comm, "device", "cpu")
    sent = 0
    last = None
    for plan, chunk in gathered_buckets(plans, params, gather):
        if comm is not None:
            last = pack_bucket(plan, chunk, device)
            comm.broadcast(last, src=0)
            sent += plan.nbytes
    if last is not None and last.is_cuda:
        torch.cuda.current_stream(last.device).synchronize()
    return sent


# ---- engine side ----------------------------------------------------------------------------------------------
def receive_buckets(comm, plans: Sequence[BucketPlan], device: torch.device | str
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive the buckets one by one (each into a fresh buffer, kept alive by the views it yields)."""
    for plan in plans:
        buf = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
        comm.broadcast(buf, src=0)
        yield from unpack_bucket(plan, buf)


class NcclWeightSyncExtension(WeightSyncExtension):
    """vLLM ``worker_extension_cls`` (``workers.nccl_sync.NcclWeightSyncExtension``): the object-store reload of
    :class:`WeightSyncExtension` plus the collective push. Reached with ``llm.collective_rpc``; ``self`` is the
    vLLM worker (``self.rank`` is its rank within the engine, ``self.device`` its device)."""

    def fleetrl_init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                  backend: str = "nccl", timeout_s: float | None = None) -> int:
        """Join the learner's weight group as rank ``rank_offset + self.rank``; returns that rank."""
        rank = rank_offset + self.rank
        self._fleetrl_weight_comm = weight_communicator(backend, host, port, rank, world_size, self.device,
                                                        timeout_s=timeout_s)
        return rank

    def fleetrl_receive_tensors(self, plans: Sequence[BucketPlan]) -> list[tuple[str, torch.Tensor]]:
        """Receive one push and return its tensors as CPU copies (a LoRA adapter the rollout actor serves)."""
        comm = getattr(self, "_fleetrl_weight_comm", None)
        if comm is None:
            raise RuntimeError("fleetrl_receive_tensors before fleetrl_init_weight_group: this worker is not in a "
                               "weight group")
        return [(name, t.to("cpu", copy=True)) for name, t in receive_buckets(comm, plans, self.device)]

    def fleetrl_receive_weights(self, plans: Sequence[BucketPlan]) -> int:
        """Receive one push and reload the model in place; returns the number of tensors loaded. Every bucket is
        received even if the reload fails part-way, so the sender and the other engines are not left hanging."""
        comm = getattr(self, "_fleetrl_weight_comm", None)
        if comm is None:
            raise RuntimeError("fleetrl_receive_weights before fleetrl_init_weight_group: this worker is not in a "
                               "weight group")
        stream = receive_buckets(comm, plans, self.device)
        try:
            loaded = self.fleetrl_reload_weights(stream)
        finally:
            for _ in stream:  # drain: a broadcast must be matched on every rank
                pass
        expected = sum(len(p.names) for p in plans)
        if loaded != expected:
            raise RuntimeError(f"reload consumed {loaded} of the {expected} pushed tensors")
        return loaded
