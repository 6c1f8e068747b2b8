"""The learner group: the `learner-i` (or `critic-i`) DeepSpeed ranks as Ray actors in one placement group, and
the helpers that gather their calls (a dead rank ends the run: :class:`LearnerDied`)."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.net import free_port
from learner.batch import TrainBatch
from learner.worker import LearnerWorker
from orchestrator.config import FleetConfig
from orchestrator.rl.pools import DIED, StartupTimeout, _free
from orchestrator.rl.specs import learner_spec, log_env, placement_key
from orchestrator.telemetry.console import actor_failed, actor_label, remember_actor


class LearnerGroup:
    """The `learner-i` ranks (or `critic-i` for the value model): one torch.distributed group in one PACK
    placement group."""

    def __init__(self, cfg: FleetConfig, role: str = "actor"):
        lc = cfg.learner
        self.cfg = cfg
        self.role = role
        self.prefix = prefix = "critic" if role == "critic" else "learner"
        self.world = lc.num_ranks
        self.placement = placement_key(cfg)
        bundle = {"CPU": lc.num_cpus, **({"GPU": lc.num_gpus} if lc.num_gpus else {}), **lc.resources}
        self.pg = placement_group([dict(bundle) for _ in range(self.world)], strategy="PACK")
        if not ray.wait([self.pg.ready()], timeout=cfg.run.startup_timeout_s)[0]:
            raise StartupTimeout(f"{prefix} placement group ({self.world} x {bundle}) not placed after "
                                 f"{cfg.run.startup_timeout_s:g} s (run.startup_timeout_s); the cluster has free "
                                 f"{_free()}")
        master_addr = self._bundle0_ip()
        port = lc.master_port or free_port()
        spec = learner_spec(cfg, role)
        self.micro_batch_size = spec.ds_config["train_micro_batch_size_per_gpu"]
        self.ranks = [
            ray.remote(LearnerWorker).options(
                name=f"{prefix}-{r}", num_cpus=lc.num_cpus, num_gpus=lc.num_gpus, resources=lc.resources or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
                runtime_env={"env_vars": log_env(cfg)},
            ).remote(r, self.world, master_addr, port, spec, cfg.trainer.torch_threads)
            for r in range(self.world)
        ]
        for r, handle in enumerate(self.ranks):
            remember_actor(handle, f"{prefix}-{r}", cfg.run.dir)

    def load(self, cfg: FleetConfig) -> list:
        """Another run on these ranks (same placement, :func:`placement_key`): every rank builds ``cfg``'s model,
        loss and optimizer (:meth:`LearnerWorker.load`); returns the ObjectRefs to wait for."""
        self.cfg, spec = cfg, learner_spec(cfg, self.role)
        self.micro_batch_size = spec.ds_config["train_micro_batch_size_per_gpu"]
        return [w.load.remote(spec) for w in self.ranks]

    def ready(self) -> list:
        """ObjectRefs that resolve once every rank has built its DeepSpeed engine (see :func:`wait_ready`)."""
        return [w.ready.remote() for w in self.ranks]

    def handles(self) -> list:
        """Every rank's actor."""
        return list(self.ranks)

    def _bundle0_ip(self) -> str:
        node_id = ray.util.placement_group_table(self.pg)["bundles_to_node_id"][0]
        for node in ray.nodes():
            if node["NodeID"] == node_id:
                return node["NodeManagerAddress"]
        return "127.0.0.1"

    def _get(self, refs):
        return get_ranks(refs, self.prefix)

    def compute_logprobs(self, batch: TrainBatch, temperature: float | None = None) -> TrainBatch:
        """Fill ``old_logprobs`` and ``ref_logprobs`` (one no-grad pass of each model, rows split over ranks);
        ``temperature``: the policy's at this temperature instead of the spec's."""
        import torch

        outs = self._get([w.compute_logprobs.remote(s, self.micro_batch_size, temperature)
                          for w, s in zip(self.ranks, batch.shards(self.world))])
        batch.old_logprobs = torch.cat([o["old_logprobs"] for o in outs])
        batch.ref_logprobs = torch.cat([o["ref_logprobs"] for o in outs]) if outs[0]["ref_logprobs"] is not None \
            else None
        return batch

    def compute_values(self, batch: TrainBatch):
        """Critic values ``[B, T]`` (rows split over ranks)."""
        import torch

        return torch.cat(self._get([w.compute_values.remote(s, self.micro_batch_size)
                                    for w, s in zip(self.ranks, batch.shards(self.world))]))

    def train_async(self, batch: TrainBatch) -> list:
        """Start training on the batch; returns the ranks' ObjectRefs (see :func:`gather_metrics`). Split into
        minibatches (each its own loss scale), then each minibatch over ranks."""
        lc = self.cfg.learner
        minibatches = [mb.with_scale() for mb in batch.shards(lc.num_minibatches)]
        per_rank = list(zip(*[mb.shards(self.world) for mb in minibatches]))
        return [w.train.remote(list(shards), lc.epochs, self.micro_batch_size)
                for w, shards in zip(self.ranks, per_rank)]

    def weight_buckets(self) -> list:
        """ObjectRefs of the current weights in buckets (every rank takes part in the ZeRO-3 gather)."""
        outs = self._get([w.weight_buckets.remote(self.cfg.rollout.weight_bucket_mb) for w in self.ranks])
        return outs[0]

    def weight_checksums(self) -> dict[str, tuple[float, float]]:
        """``name -> (sum, sum of |x|)`` of every floating tensor a push sends (rank 0's, see the worker)."""
        return self._get([w.weight_checksums.remote(self.cfg.rollout.weight_bucket_mb) for w in self.ranks])[0]

    def open_weight_group(self, engines: int, workers_per_engine: int, backend: str,
                          timeout_s: float | None = None) -> tuple[list, int, tuple]:
        """Start learner rank 0's side of a weight group for ``engines`` engines; returns its ObjectRefs, the group
        size and the rendezvous address (host, port) the engines join at."""
        from workers.nccl_sync import group_world_size

        world = group_world_size(engines, workers_per_engine)
        endpoint = self._get([self.ranks[0].weight_endpoint.remote()])[0]
        return [self.ranks[0].join_weight_group.remote(*endpoint, world, backend, timeout_s)], world, tuple(endpoint)

    def weight_plans(self, bucket_mb: float) -> list:
        from workers.weight_buckets import plan_buckets

        return plan_buckets(self._get([self.ranks[0].weight_specs.remote()])[0], int(bucket_mb * 2**20))

    def broadcast_weights(self, plans: list) -> list:
        return [w.broadcast_weights.remote(plans) for w in self.ranks]

    def save_hf(self, out_dir: str) -> None:
        self._get([w.save_hf.remote(out_dir) for w in self.ranks])

    def save_checkpoint(self, path: str) -> None:
        self._get([w.save_checkpoint.remote(path) for w in self.ranks])

    def load_checkpoint(self, path: str) -> None:
        self._get([w.load_checkpoint.remote(path) for w in self.ranks])


class LearnerDied(RuntimeError):
    """A learner or critic rank died: the run stops (resume from the last checkpoint)."""


def get_ranks(refs: list, group: str = "learner") -> list:
    """ray.get over a learner group's calls, ``refs[r]`` being rank r's; a dead rank becomes :class:`LearnerDied`
    (the group cannot go on), a rank whose method raised an error naming the rank and its log."""
    out = []
    for rank, ref in enumerate(refs):  # all are in flight already: getting them in order costs nothing
        try:
            out.append(ray.get(ref))
        except DIED as e:
            name = actor_label(e) or actor_label(f"{group}-{rank}") or f"a {group} rank"
            raise LearnerDied(f"{name} died ({type(e).__name__}); the group cannot continue without it") from e
        except ray.exceptions.RayTaskError as e:
            raise actor_failed(f"{group}-{rank}", e) from e
    return out


@dataclass
class Update:
    """A learner group's optimizer step(s) on one batch: the metrics (summed over ranks, see
    :func:`gather_metrics`) and whether any rank skipped its update for a NaN/Inf gradient."""

    metrics: dict
    skipped: bool = False


def gather_update(refs: list, group: str = "learner", role: str = "actor") -> Update:
    """:meth:`LearnerGroup.train_async`'s results as an :class:`Update` (the ranks report skipped steps as
    ``<role>/skipped_step_frac``; this is the one place that reads it)."""
    metrics = gather_metrics(refs, group)
    return Update(metrics, metrics.get(f"{role}/skipped_step_frac", 0.0) > 0)


def gather_metrics(refs: list, group: str = "learner") -> dict:
    """Sum the ranks' additive metric shares (keys ending in ``_max`` take the max over ranks)."""
    outs = get_ranks(refs, group)
    return {k: max(o[k] for o in outs) if k.endswith("_max") else sum(o[k] for o in outs) for k in outs[0]}
