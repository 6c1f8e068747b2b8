"""A collective push whose peer dies or stalls mid-broadcast fails within ``rollout.weight_sync_timeout_s`` instead
of hanging: the real weight group (workers/nccl_sync.py, vLLM's stateless gloo group) of two processes, rank 0
broadcasting 64 MB buckets as learner rank 0 does, rank 1 an engine worker that exits or stops receiving."""

import multiprocessing as mp
import os
import time

import pytest

TIMEOUT_S = 3.0


def _sender(ports, results, timeout_s):
    import torch

    from workers.nccl_sync import open_endpoint, weight_communicator

    host, port, sock = open_endpoint("127.0.0.1")
    ports.put(port)
    comm = weight_communicator("gloo", host, port, 0, 2, "cpu", listen_socket=sock, timeout_s=timeout_s)
    bucket = torch.ones(64 * 2**20, dtype=torch.uint8)
    t0 = time.perf_counter()
    try:
        for _ in range(20):  # every push's buckets, one after another
            comm.broadcast(bucket, src=0)
        results.put(("finished", time.perf_counter() - t0, ""))
    except Exception as e:  # noqa: BLE001 - what the driver would see from the learner's push
        results.put(("raised", time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:300]))


def _receiver(ports, how, timeout_s):
    import torch

    from workers.nccl_sync import weight_communicator

    comm = weight_communicator("gloo", "127.0.0.1", ports.get(), 1, 2, "cpu", timeout_s=timeout_s)
    buf = torch.empty(64 * 2**20, dtype=torch.uint8)
    comm.broadcast(buf, src=0)  # the first bucket arrives, then the engine dies or stalls
    if how == "dies":
        os._exit(1)
    time.sleep(120)


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_push_whose_peer_dies_or_stalls_mid_broadcast_fails_within_the_bound(how):
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    sender = ctx.Process(target=_sender, args=(ports, results, TIMEOUT_S))
    sender.start()
    port = ports.get(timeout=60)
    ports.put(port)
    receiver = ctx.Process(target=_receiver, args=(ports, how, TIMEOUT_S))
    receiver.start()
    try:
        outcome, seconds, error = results.get(timeout=90)  # without the bound: torch's 30 minutes
    finally:
        for p in (sender, receiver):
            p.kill()
            p.join()
    assert outcome == "raised", (outcome, seconds)
    assert seconds < TIMEOUT_S + 15, (seconds, error)
