"""One object owns the learner -> engines weight push: :class:`WeightSync`, made by :func:`make_weight_sync` from
``rollout.weight_sync`` and held by the trainer. ``push(version)`` puts the learner's current weights into every
running engine, in place, and returns the push's metrics.

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
import time

from orchestrator.config import FleetConfig
from orchestrator.pools import LearnerGroup, RolloutPool, get_ranks

log = logging.getLogger("fleetrl")


class WeightSync:
    def __init__(self, cfg: FleetConfig, learner: LearnerGroup, rollouts: RolloutPool):
        self.cfg, self.learner, self.rollouts = cfg, learner, rollouts

    def push(self, version: int) -> dict:
        """Every engine serves the learner's current weights as ``version``; returns ``weight_sync/*`` metrics."""
        raise NotImplementedError


class ObjectStoreSync(WeightSync):
    def push(self, version: int) -> dict:
        t0 = time.perf_counter()
        buckets = self.learner.weight_buckets()
        t1 = time.perf_counter()
        loads = self.rollouts.load_weights(buckets, version)
        return {"weight_sync/gather_s": t1 - t0, "weight_sync/load_s": time.perf_counter() - t1,
                "weight_sync/engine_reload_s": max(x["seconds"] for x in loads), "weight_sync/buckets": len(buckets)}


class CollectiveSync(WeightSync):
    def __init__(self, cfg: FleetConfig, learner: LearnerGroup, rollouts: RolloutPool):
        super().__init__(cfg, learner, rollouts)
        self.membership = -1  # the rollout pool membership the group was formed for
        self.plans: list = []

    def push(self, version: int) -> dict:
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
            len(self.rollouts.workers), self.cfg.rollout.tensor_parallel_size, backend)
        ray.get(self.rollouts.join_weight_group(*endpoint, world, backend))
        get_ranks(learner_refs)
        self.membership = self.rollouts.membership
        log.info("weight group (%s) of %d ranks formed; %d buckets per push", backend, world, len(self.plans))


def make_weight_sync(cfg: FleetConfig, learner: LearnerGroup, rollouts: RolloutPool) -> WeightSync:
    return (CollectiveSync if cfg.rollout.weight_sync == "collective" else ObjectStoreSync)(cfg, learner, rollouts)
