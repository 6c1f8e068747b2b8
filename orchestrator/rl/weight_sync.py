"""One object owns the learner -> engines weight push: :class:`WeightSync`, made by :func:`make_weight_sync` from
``rollout.weight_sync`` and held by the trainer. ``push(version)`` puts the learner's current weights into every
running engine, in place, checks that they arrived, and returns the push's metrics.

The check is the one number for "the engine matches the learner", ``weight_sync/logprob_max_diff``, the same in
every rollout mode: after the push every engine samples a fixed probe prompt (fixed seed, the run's
temperature), the learner scores those tokens with the weights it just pushed, and the metric is the largest
|engine - learner| logprob over all engines' tokens (fp32: ~1e-6; bf16 engines: rounding, ~1e-2). How far the
batch a step trains on lags the learner is a separate question with its own keys (``rollout/staleness_max``,
``rollout/logprob_gap_max``, see the trainer).

- :class:`ObjectStoreSync`: the learner packs its weights into byte buckets in Ray's object store; every engine
  reloads from them. A new or replaced engine loads the last pushed buckets (the pool keeps them), so it serves
  exactly the version the others serve, even mid-step in ``one_step_off``.
- :class:`CollectiveSync`: learner rank 0 broadcasts the buckets straight into every engine over a process group
  (NCCL on GPU, gloo on CPU). The group is formed for the pool's current membership and formed again when it
  changed (an engine replaced, the pool resized); a new engine first gets the current weights through the object
  store (``RolloutPool`` asks :meth:`LearnerGroup.weight_buckets`).
"""

from __future__ import annotations

import logging
import os
import time

from learner.batch import build_batch
from orchestrator.config import FleetConfig
from orchestrator.rl.learner_group import LearnerGroup, get_ranks
from orchestrator.rl.pools import RolloutPool
from rewards.tasks import Prompt

log = logging.getLogger("fleetrl")


PROBE_TOKENS = 16  # tokens each engine samples for the push check
PROBE_SEED = 20_011
FAULT_CORRUPT_PUSH = "FLEETRL_FAULT_CORRUPT_PUSH"
"""A test's injected fault: the driver doubles the named tensor in every object-store push (tests/test_doctor.py)."""


class WeightSync:
    def __init__(self, cfg: FleetConfig, learner: LearnerGroup, rollouts: RolloutPool, probe: list[Prompt],
                 pad_id: int):
        """``probe``: the prompts every engine samples after a push (:meth:`check`); ``pad_id`` pads them."""
        self.cfg, self.learner, self.rollouts = cfg, learner, rollouts
        self.probe, self.pad_id = probe, pad_id
        self._bytes: int | None = None

    def push(self, version: int) -> dict:
        """Every engine serves the learner's current weights as ``version``; returns ``weight_sync/*`` metrics,
        ``weight_sync/logprob_max_diff`` and ``weight_sync/bytes`` among them."""
        metrics = self._push(version)
        metrics["weight_sync/bytes"] = self.push_bytes()
        t0 = time.perf_counter()
        metrics["weight_sync/logprob_max_diff"] = self.check()
        metrics["weight_sync/check_s"] = time.perf_counter() - t0
        return metrics

    def _push(self, version: int) -> dict:
        raise NotImplementedError

    def push_bytes(self) -> int:
        """The bytes of tensors one push sends to each engine (fixed for a run: every tensor, or with LoRA the
        adapted blocks' merged weights), alignment padding not counted."""
        if self._bytes is None:
            from workers.weight_buckets import tensor_nbytes

            plans = self.learner.weight_plans(self.cfg.rollout.weight_bucket_mb)
            self._bytes = sum(tensor_nbytes(*spec) for p in plans for spec in zip(p.names, p.shapes, p.dtypes))
        return self._bytes

    def check(self) -> float:
        """Largest |engine - learner| logprob of the tokens every engine samples from the probe prompts."""
        samples = self.rollouts.probe(self.probe, min(PROBE_TOKENS, self.cfg.rollout.max_new_tokens), PROBE_SEED)
        world = self.learner.world
        rows = [samples[i % len(samples)] for i in range(-(-len(samples) // world) * world)]
        batch = self.learner.compute_logprobs(build_batch(
            [s.prompt_ids for s in rows], [s.completion_ids for s in rows], [s.logprobs for s in rows], self.pad_id))
        mask = batch.response_mask.bool()
        return (batch.old_logprobs - batch.rollout_logprobs).abs()[mask].max().item() if mask.any() else 0.0


class ObjectStoreSync(WeightSync):
    def _push(self, version: int) -> dict:
        t0 = time.perf_counter()
        buckets = self.learner.weight_buckets()
        if os.environ.get(FAULT_CORRUPT_PUSH):
            buckets = corrupted(buckets, os.environ[FAULT_CORRUPT_PUSH])
        t1 = time.perf_counter()
        loads = self.rollouts.load_weights(buckets, version)
        return {"weight_sync/gather_s": t1 - t0, "weight_sync/load_s": time.perf_counter() - t1,
                "weight_sync/engine_reload_s": max(x["seconds"] for x in loads), "weight_sync/buckets": len(buckets)}


class CollectiveSync(WeightSync):
    def __init__(self, cfg: FleetConfig, learner: LearnerGroup, rollouts: RolloutPool, probe: list[Prompt],
                 pad_id: int):
        super().__init__(cfg, learner, rollouts, probe, pad_id)
        self.membership = -1  # the rollout pool membership the group was formed for
        self.plans: list = []

    def _push(self, version: int) -> dict:
        import ray

        t0 = time.perf_counter()
        if self.membership != self.rollouts.membership:
            self._form_group()
        t1 = time.perf_counter()
        refs = self.learner.broadcast_weights(self.plans)
        loads = ray.get(self.rollouts.receive_weights(self.plans, version))
        get_ranks(refs)
        return {"weight_sync/group_s": t1 - t0, "weight_sync/load_s": time.perf_counter() - t1,
                "weight_sync/engine_reload_s": max(x["seconds"] for x in loads), "weight_sync/buckets": len(self.plans)}

    def _form_group(self) -> None:
        """Learner rank 0 and every engine worker join one process group (a rendezvous at rank 0's address)."""
        import ray
        import torch

        backend = "nccl" if torch.cuda.is_available() or self.cfg.rollout.num_gpus else "gloo"
        self.plans = self.learner.weight_plans(self.cfg.rollout.weight_bucket_mb)
        learner_refs, world, endpoint = self.learner.open_weight_group(
            len(self.rollouts.workers), self.cfg.rollout.tensor_parallel_size, backend,
            self.cfg.rollout.weight_sync_timeout_s)
        ray.get(self.rollouts.join_weight_group(*endpoint, world, backend, self.cfg.rollout.weight_sync_timeout_s))
        get_ranks(learner_refs)
        self.membership = self.rollouts.membership
        log.info("weight group (%s) of %d ranks formed; %d buckets per push", backend, world, len(self.plans))


def corrupted(buckets: list, name: str) -> list:
    """``buckets`` with tensor ``name`` doubled in a copy of its bucket (the injected corrupt push)."""
    import numpy as np
    import ray
    import torch

    from workers.weight_buckets import unpack_bucket

    out = list(buckets)
    for i, ref in enumerate(buckets):
        plan, data = ray.get(ref)
        if name in plan.names:
            data = np.array(data)  # a writable copy
            dict(unpack_bucket(plan, torch.from_numpy(data)))[name].mul_(2.0)
            out[i] = ray.put((plan, data))
    return out


def make_weight_sync(cfg: FleetConfig, learner: LearnerGroup, rollouts: RolloutPool, probe: list[Prompt],
                     pad_id: int) -> WeightSync:
    kind = CollectiveSync if cfg.rollout.weight_sync == "collective" else ObjectStoreSync
    return kind(cfg, learner, rollouts, probe, pad_id)
