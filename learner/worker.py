"""`learner-i` Ray actors: one rank each of a torch.distributed group, the policy in a DeepSpeed engine.

The learner is algorithm-blind: it consumes :class:`TrainBatch` shards carrying per-token advantages and
masks, and a dict of keyword arguments for :func:`learner.losses.policy_loss`. GRPO, RLOO, PPO, ... differ
only in what the driver puts in the batch.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from common.actor_logs import LoggedActor, peak_rss_mb
from common.imports import skip_unused_comm_op, skip_unused_imports
from learner.batch import TrainBatch
from learner.forward import HiddenStatesLM, critic_values, policy_logprobs
from learner.losses import loss_inputs
from learner.packing import Layout, filler, micro_batches


def _set_dist_env(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _join_on_one_machine(rank: int, world_size: int, master_addr: str, backend: str) -> None:
    """With a loopback master address (every rank on this machine, as in a private local run), join the group
    through a FileStore in the temp directory before DeepSpeed does (it then uses this group): torch's TCPStore
    listens on every interface whatever MASTER_ADDR says. The file is named after the Ray placement group the
    ranks share, so a run that died never leaves a stale one to a later group. Elsewhere: DeepSpeed's TCP
    rendezvous at MASTER_ADDR (docs/cluster.md: what a cluster operator must protect)."""
    import tempfile

    import ray
    import torch.distributed as dist

    group = ray.util.get_current_placement_group() if ray.is_initialized() else None
    if master_addr not in LOOPBACK or dist.is_initialized() or group is None:
        return
    path = os.path.join(tempfile.gettempdir(), f"fleetrl-rendezvous-{group.id.hex()}")
    dist.init_process_group(backend, store=dist.FileStore(path, world_size), rank=rank, world_size=world_size)


@dataclass(frozen=True)
class LearnerSpec:
    """What a learner group trains and how: the typed record the driver sends every rank
    (:func:`orchestrator.rl.specs.learner_spec` builds it from the config). ``role="actor"``: causal LM policy +
    frozen reference (``reference``), trained with the registered loss of ``loss_kwargs``; ``lora``
    (:meth:`orchestrator.config.lora.LoraSection.spec`): PEFT adapters on it, the base frozen and serving as the
    reference with the adapters off (:mod:`learner.lora`). ``role="critic"``: the same architecture with a scalar
    head (initialized from the policy weights, head fresh), trained with ``value_loss(**loss_kwargs)``; with
    ``lora`` its own adapters and value head on its frozen base. ``layout``: packing, logprob chunking,
    token-budget micro-batches (:class:`learner.packing.Layout`); ``autocast``: the mixed-precision compute dtype."""

    model_path: str
    dtype: str
    ds_config: dict
    loss_kwargs: dict
    temperature: float
    seed: int
    gradient_checkpointing: bool = False
    role: str = "actor"
    reference: bool = True
    autocast: str | None = None
    layout: Layout = field(default_factory=Layout)
    lora: dict | None = None
    load_kwargs: dict = field(default_factory=dict)  # from_pretrained's: trust_remote_code, attn_implementation
    schedule: dict | None = None  # lr_factor's keywords (kind, warmup, total, min_ratio); None: ds_config's
    push_dtype: str | None = None  # the engines' dtype: a push sends floating tensors no wider than it


class LearnerWorker(LoggedActor):
    """Plain class; the orchestrator wraps it with ``ray.remote`` and names it ``learner-i``. The process joins
    the group's torch.distributed group once; :meth:`load` builds (and can rebuild, for the next run on the same
    fleet) the models and the DeepSpeed engine of a :class:`LearnerSpec`."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, spec: LearnerSpec,
                 torch_threads: int):
        self._start_logging()
        skip_unused_imports()
        import torch

        torch.set_num_threads(torch_threads)
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _set_dist_env(rank, world_size, master_addr, master_port)
        import deepspeed

        if not on_gpu:
            skip_unused_comm_op()
        _join_on_one_machine(rank, world_size, master_addr, "nccl" if on_gpu else "gloo")
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        # a token budget gives ranks different micro-batch counts: they agree on the largest over this group
        self._count_group = torch.distributed.new_group(backend="gloo") if world_size > 1 else None
        # set by load: the DeepSpeed engine, the HF model it wraps (PEFT's model with LoRA), the frozen reference
        self.engine: Any = None
        self.hf_model: Any = None
        self.peft: Any = None
        self.ref: Any = None
        self.load(spec)

    def load(self, spec: LearnerSpec) -> str:
        """Build the models and the DeepSpeed engine of ``spec`` (a fresh optimizer), replacing any earlier ones;
        returns this rank's name."""
        import gc

        import deepspeed
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        if getattr(self, "engine", None) is not None:  # the previous run's: its ZeRO optimizer's gradient hooks
            self.engine.destroy()  # live in C++ on the parameters and keep the whole engine alive unless removed
            _forget_zero3_state()
        self.engine = self.ref = self.hf_model = self.peft = None
        gc.collect()
        torch.manual_seed(spec.seed + self.rank)
        torch_dtype, role, lora = getattr(torch, spec.dtype), spec.role, spec.lora
        self.role = role
        self.autocast = getattr(torch, spec.autocast) if spec.autocast else None  # mixed precision: compute dtype
        self.lora_push = (lora or {}).get("push", "merged")
        self.push_dtype = spec.push_dtype
        self.has_ref = spec.reference and role != "critic"
        if role == "critic":
            self.hf_model = AutoModelForTokenClassification.from_pretrained(spec.model_path, num_labels=1,
                                                                            dtype=torch_dtype, **spec.load_kwargs)
            model = self.hf_model
            _disable_dropout(model)  # as the policy's: values must not depend on which pass computes them
            if lora:  # its own adapters and its value head on its own frozen base
                from learner.lora import add_adapters, checkpoint_adapters_only

                self.peft = add_adapters(self.hf_model, lora, value_head=True)
                checkpoint_adapters_only(model)
        else:
            self.hf_model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=torch_dtype, **spec.load_kwargs)
            _disable_dropout(self.hf_model)  # the learner's logprobs must equal the engine's (and the old policy's)
            if lora:
                from learner.lora import add_adapters, checkpoint_adapters_only

                self.peft = add_adapters(self.hf_model, lora)  # the reference is the base: adapters off
            model = HiddenStatesLM(self.hf_model)  # the engine's forward gives hidden states; the head runs chunked
            if lora:
                checkpoint_adapters_only(model)  # a checkpoint holds the adapters, not the frozen base
            if spec.reference and not lora:
                lm: Any = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=torch_dtype, **spec.load_kwargs)
                lm = lm.to(self.device).eval()
                self.ref = HiddenStatesLM(lm.requires_grad_(False))
        if spec.gradient_checkpointing:
            self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # from_pretrained returns eval mode, where transformers skips gradient checkpointing
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
        scheduler = functools.partial(lr_scheduler, **spec.schedule) if spec.schedule else None
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=spec.ds_config,
                                               lr_scheduler=scheduler)
        _load_checkpoints_weights_only(self.engine)
        # the registered loss (learner.losses.LOSSES) this group trains with, and its settings
        self.objective = spec.loss_kwargs.get("objective", "value" if role == "critic" else "policy")
        self.loss_kwargs = {k: v for k, v in spec.loss_kwargs.items() if k != "objective"}
        self.layout = spec.layout
        self.reads = loss_inputs(self.objective)  # what this group's loss reads from a micro-batch
        self.with_entropy = "entropy" in self.reads and (self.layout.entropy
                                                         or bool(spec.loss_kwargs.get("entropy_coef")))
        self.temperature = spec.temperature
        self.zero_stage = spec.ds_config["zero_optimization"]["stage"]
        self.model_path = spec.model_path
        return self.name

    # ---- forward passes -------------------------------------------------------------------------------
    def _forward(self, model, mb: TrainBatch, with_entropy: bool = False, temperature: float | None = None):
        """``(logp [b, T], entropy [b, T] or None)`` of the micro-batch's response tokens (see
        :func:`learner.forward.policy_logprobs`) at ``temperature`` (default: the spec's). Training passes go
        through the engine (``model`` is ``self.engine``), no-grad passes may call its module."""
        t = self.temperature if temperature is None else temperature
        return policy_logprobs(model, mb, self.layout, t, with_entropy, self.device, self.autocast)

    def _ref_logprobs(self, mb: TrainBatch):
        """The reference policy's logprobs ``[b, T]`` (no grad): the frozen copy, or with LoRA the policy with its
        adapters switched off."""
        import torch

        with torch.no_grad(), self.peft.disable_adapter() if self.peft else contextlib.nullcontext():
            return self._forward(self.engine if self.peft else self.ref, mb)[0]

    def _values(self, model, mb: TrainBatch):
        return critic_values(model, mb, self.layout, self.device, self.autocast)

    def _micro(self, shard: TrainBatch, micro_batch_size: int) -> list[TrainBatch]:
        """The shard's micro-batches (rows, or a token budget); every rank runs as many as the rank with most."""
        micro = micro_batches(shard, micro_batch_size, self.layout.micro_batch_tokens)
        return micro + [filler(shard)] * (self._max_count(micro) - len(micro))

    def _max_count(self, micro: list) -> int:
        if self.world_size == 1 or not self.layout.micro_batch_tokens:
            return len(micro)
        import torch
        import torch.distributed as dist

        n = torch.tensor([len(micro)])
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self._count_group)
        return int(n)

    def compute_values(self, shard: TrainBatch, micro_batch_size: int):
        """Critic values of the shard's response positions, ``[b, T]``."""
        import torch

        with torch.no_grad():
            return _concat([self._values(self.engine.module, mb).cpu() for mb in self._micro(shard, micro_batch_size)],
                           shard)

    def compute_logprobs(self, shard: TrainBatch, micro_batch_size: int, temperature: float | None = None) -> dict:
        """Policy (before the update) and reference logprobs of the shard's response tokens, ``[b, T]`` each;
        ``temperature``: the policy's at another temperature than the spec's (the mismatch doctor)."""
        import torch

        old, ref = [], []
        with torch.no_grad():
            for mb in self._micro(shard, micro_batch_size):
                old.append(self._forward(self.engine, mb, temperature=temperature)[0].cpu())
                if self.has_ref:
                    ref.append(self._ref_logprobs(mb).cpu())
        return {"old_logprobs": _concat(old, shard), "ref_logprobs": _concat(ref, shard) if ref else None}

    # ---- training -------------------------------------------------------------------------------------
    def train(self, minibatches: list[TrainBatch], epochs: int, micro_batch_size: int) -> dict:
        """One optimizer step per minibatch shard and epoch. Returns metrics summed over this rank's
        micro-batches (additive shares: the group sums them over ranks) and averaged over optimizer steps."""
        t0 = time.perf_counter()
        loss_fn = self._critic_loss if self.role == "critic" else self._actor_loss
        sums: dict[str, float] = defaultdict(float)
        n_steps, lr = 0, self.engine.get_lr()[0]  # the LR of this call's first optimizer step
        for epoch in range(epochs):
            for i, shard in enumerate(minibatches):
                micro = self._micro(shard, micro_batch_size)
                skipped, zero0_norm = False, None
                for j, mb in enumerate(micro):
                    # the micro-batch count varies with a token budget: say where the optimizer step falls
                    self.engine.set_gradient_accumulation_boundary(j == len(micro) - 1)
                    loss, metrics = loss_fn(mb, first_pass=epoch == 0 and i == 0)
                    # loss is this micro-batch's share of the minibatch loss; DeepSpeed averages gradients
                    # over ranks, so undo that division to keep the sum (split invariance).
                    self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
                    if j == len(micro) - 1 and self.zero_stage == 0:
                        zero0_norm = self._grad_norm()
                        skipped = self._drop_nonfinite_grads()
                    self.engine.step()
                    if skipped and self.engine.lr_scheduler is None:  # a scheduler already set the next LR
                        self._restore_lr()
                    for k, v in metrics.items():
                        sums[k] = max(sums[k], float(v)) if k.endswith("_max") else sums[k] + float(v)
                # ZeRO 1-3 (and DeepSpeed's bf16/fp16 optimizers) keep the norm they clipped with; ZeRO-0 in fp32
                # clips with torch's norm and keeps none (get_global_grad_norm() is None): use our own
                norm = self.engine.get_global_grad_norm()
                norm = float((zero0_norm or 0.0) if norm is None else norm)
                # ZeRO 1-3 skip a step whose global grad norm is NaN/Inf themselves (and report it as inf)
                skipped = skipped or not math.isfinite(norm)
                sums[f"{self.role}/grad_norm"] += (norm if math.isfinite(norm) else 0.0) / self.world_size
                sums[f"{self.role}/skipped_step_frac"] += skipped / self.world_size
                n_steps += 1
        out = {k: v if k.endswith("_max") else v / n_steps for k, v in sums.items()}
        out[f"{self.role}/lr"] = lr / self.world_size
        out[f"time/{self.role}_compute_s"] = (time.perf_counter() - t0) / self.world_size
        out.update(_memory_metrics(self.role))
        return out

    def _grad_norm(self) -> float:
        """ZeRO-0: the global 2-norm of the gradients before clipping, as DeepSpeed's clip computes it. After the
        boundary all-reduce every rank holds the full, identical gradients."""
        import torch

        norms = [p.grad.detach().float().norm() for p in self.hf_model.parameters() if p.grad is not None]
        return float(torch.stack(norms).norm()) if norms else 0.0

    def _drop_nonfinite_grads(self) -> bool:
        """ZeRO-0: after the boundary all-reduce every rank holds the same gradients. If any is NaN/Inf, zero
        them and set the LR to 0 for this one optimizer step, so the weights do not change (AdamW's moments
        still decay by one step). ZeRO 1-3 skip such steps inside DeepSpeed."""
        import torch

        grads = [p.grad for p in self.hf_model.parameters() if p.grad is not None]
        if all(torch.isfinite(g).all() for g in grads):
            return False
        for g in grads:
            g.zero_()
        self._saved_lr = [group["lr"] for group in self.engine.optimizer.param_groups]
        for group in self.engine.optimizer.param_groups:
            group["lr"] = 0.0
        return True

    def _restore_lr(self) -> None:
        for group, lr in zip(self.engine.optimizer.param_groups, self._saved_lr):
            group["lr"] = lr

    def _actor_loss(self, mb: TrainBatch, first_pass: bool = False):
        """The objective's loss of one micro-batch (policy gradient, SFT, DPO: :func:`learner.losses.call_loss`).
        When the driver sent no reference logprobs the reference forward runs here, fused into the training pass
        (no separate round trip); when it sent no old logprobs (a batch used once) this first pass's own logprobs
        are the old ones. On the first pass over a policy-gradient batch (weights not yet updated) the
        |learner - engine| logprob gap of the sampled tokens is measured for free (largest, p99 bound, sum)."""
        from learner.losses import call_loss

        if mb.ref_logprobs is None and self.has_ref:
            mb = replace(mb, ref_logprobs=self._ref_logprobs(mb))
        logp, entropy = self._forward(self.engine, mb, with_entropy=self.with_entropy)
        mb = mb.to(self.device)
        if mb.old_logprobs is None and "old_logp" in self.reads:  # used once: the current policy is the old one
            if not first_pass:
                raise ValueError("old_logprobs are needed after the first pass (more than one epoch or minibatch)")
            mb = replace(mb, old_logprobs=logp.detach())
        inputs = {"logp": logp, "old_logp": mb.old_logprobs, "advantages": mb.advantages, "mask": mb.response_mask,
                  "scale": mb.scale, "ref_logp": mb.ref_logprobs, "entropy": entropy,
                  "rollout_logp": mb.rollout_logprobs, "targets": mb.targets}
        loss, metrics = call_loss(self.objective, inputs, self.loss_kwargs)
        if first_pass and "rollout_logp" in self.reads:
            gap = ((logp.detach() - mb.rollout_logprobs).abs() * mb.response_mask)
            metrics["actor/rollout_logprob_gap_max"] = gap.max()
            # additive shares for the batch's mean; the micro-batches' largest p99 bounds the batch's p99
            metrics["actor/rollout_logprob_gap_sum"] = gap.sum()
            metrics["actor/rollout_logprob_gap_tokens"] = mb.response_mask.sum()
            mask = mb.response_mask > 0
            metrics["actor/rollout_logprob_gap_p99_max"] = gap[mask].quantile(0.99) if mask.any() else gap.max()
        return loss, metrics

    def _critic_loss(self, mb: TrainBatch, first_pass: bool = False):
        from learner.losses import value_loss

        values = self._values(self.engine, mb)
        mb = mb.to(self.device)
        return value_loss(values, mb.old_values, mb.returns, mb.response_mask, mb.scale, **self.loss_kwargs)

    # ---- weights out ----------------------------------------------------------------------------------
    def _weights(self, push: bool = True):
        """``(specs, tensors by name, gather)`` of the policy in the base model's format: its parameters, or with
        LoRA the merged weights (``push``: the adapted blocks' only, the rest never changes; or with
        ``learner.lora.push: adapter`` the adapter tensors alone). ``gather`` is the
        ZeRO-3 context to read full tensors in (None: they are whole, or the mapping gathers itself)."""
        import deepspeed

        from workers.weight_buckets import narrowed_specs, param_specs

        def gather(params):
            return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

        gathered = gather if self.zero_stage == 3 else None
        narrow = self.push_dtype if push else None  # an export keeps the learner's dtype
        if self.peft is None:
            return (narrowed_specs(param_specs(self.hf_model.named_parameters()), narrow),
                    dict(self.hf_model.named_parameters()), gathered)
        from learner.lora import adapter_weights, merged_weights

        if push and self.lora_push == "adapter":
            adapters = adapter_weights(self.hf_model)
            return narrowed_specs(param_specs(adapters.items()), narrow), adapters, gathered

        merged = merged_weights(self.hf_model, adapted_only=push, gather=gathered)
        return narrowed_specs(merged.specs(), narrow), merged, None

    def _gathered(self, bucket_mb: float, push: bool = True):
        """``(plan, full tensors)`` per weight bucket (:func:`workers.weight_buckets.gathered_buckets`), gathered
        from ZeRO-3 shards where needed. Under ZeRO-3 every rank must walk all of it (the gather is collective);
        only rank 0's tensors are used, and without ZeRO-3 the other ranks get nothing to walk."""
        from workers import weight_buckets as wb

        if not self._walks_weights():
            return iter(())
        specs, tensors, gather = self._weights(push)
        return wb.gathered_buckets(wb.plan_buckets(specs, int(bucket_mb * 2**20)), tensors, gather)

    def _walks_weights(self) -> bool:
        """Whether this rank walks the weights for a push or an export: rank 0, and under ZeRO-3 every rank (the
        gathers are collective). With whole parameters the others would only compute, e.g. LoRA's merged weights,
        for nothing, beside rank 0 on the same cores."""
        return self.rank == 0 or self.zero_stage == 3

    def weight_buckets(self, bucket_mb: float) -> list:
        """Put the current weights into Ray's object store as packed buckets; rank 0 returns the ObjectRefs."""
        import ray

        from workers.weight_buckets import to_object

        refs = [ray.put(to_object(plan, chunk)) for plan, chunk in self._gathered(bucket_mb) if self.rank == 0]
        return refs

    def weight_checksums(self, bucket_mb: float) -> dict[str, tuple[float, float]]:
        """Rank 0: ``name -> (sum, sum of |x|)`` in float64 of every floating tensor a push sends (the engines
        record the same of what they received: the mismatch doctor compares them)."""
        import torch

        from workers.weight_buckets import as_planned

        return {name: (float(x.sum(dtype=torch.float64)), float(x.abs().sum(dtype=torch.float64)))
                for plan, chunk in self._gathered(bucket_mb) if self.rank == 0
                for name, t, dtype in zip(plan.names, chunk, plan.dtypes) if t.is_floating_point()
                for x in (as_planned(t.detach(), dtype),)}

    # ---- collective weight push (rollout.weight_sync=collective) ---------------------------------------
    def weight_specs(self) -> list:
        """(name, full shape, dtype) of every tensor a push sends, in push order."""
        return self._weights()[0]

    def weight_endpoint(self) -> tuple[str, int]:
        """Rank 0: bind the weight group's rendezvous socket; returns (host, port) for the engines."""
        from workers import nccl_sync

        host, port, self._weight_socket = nccl_sync.open_endpoint()
        return host, port

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str,
                          timeout_s: float | None = None) -> None:
        """Rank 0 joins the weight group as its rank 0 (the other ranks only take part in ZeRO-3 gathers)."""
        from workers import nccl_sync

        if self.rank == 0:
            self._weight_comm = nccl_sync.weight_communicator(backend, host, port, 0, world_size, self.device,
                                                              listen_socket=self._weight_socket, timeout_s=timeout_s)

    def broadcast_weights(self, plans: list) -> int:
        """Every rank calls this (the ZeRO-3 gather is collective); rank 0 broadcasts each bucket."""
        from workers import nccl_sync

        if not self._walks_weights():
            return 0
        _, tensors, gather = self._weights()
        return nccl_sync.broadcast_weights(getattr(self, "_weight_comm", None) if self.rank == 0 else None, plans,
                                           tensors, gather)

    def save_hf(self, out_dir: str) -> str | None:
        """Write the policy as an HF directory (safetensors + tokenizer), gathered from all ranks. With LoRA the
        weights are merged, and ``adapter/`` beside them holds the adapter alone in PEFT's format."""
        from transformers import AutoTokenizer

        state = {n: t.detach().cpu().clone() for plan, chunk in self._gathered(1024, push=False) if self.rank == 0
                 for n, t in zip(plan.names, chunk)}
        if self.peft is not None:
            self._save_adapter(os.path.join(out_dir, "adapter"))
        if self.rank != 0:
            return None
        base = self.peft.get_base_model() if self.peft is not None else self.hf_model
        base.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(out_dir)
        return out_dir

    def _save_adapter(self, out_dir: str) -> None:
        """The adapter in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``), rank 0 writing."""
        import deepspeed

        from learner.lora import adapter_parameters

        params = list(adapter_parameters(self.hf_model).values())
        with deepspeed.zero.GatheredParameters(params) if self.zero_stage == 3 else contextlib.nullcontext():
            if self.rank == 0:
                self.peft.save_pretrained(out_dir)

    def save_checkpoint(self, path: str) -> None:
        """DeepSpeed state of this rank (weights, optimizer, LR schedule) plus its torch RNG state."""
        import torch

        self.engine.save_checkpoint(path, tag="ds", client_state={"rng": torch.get_rng_state()},
                                    save_latest=False, exclude_frozen_parameters=self.peft is not None)

    def load_checkpoint(self, path: str) -> None:
        import torch

        _, client = self.engine.load_checkpoint(path, tag="ds", load_optimizer_states=True,
                                                load_lr_scheduler_states=True, load_module_strict=self.peft is None)
        if client is None:
            raise RuntimeError(f"could not load the DeepSpeed checkpoint in {path}")
        torch.set_rng_state(client["rng"])


def _forget_zero3_state() -> None:
    """What ZeRO-3 keeps at module level after ``destroy()`` (DeepSpeed 0.19.8), each the last reference to the
    engine, model and optimizer state, so that a rank that loads another run would keep them all: the module of the
    last forward (``parameter_offload.FWD_MODULE_STACK``), and the class-level ``lru_cache`` of
    ``PartitionedParameterCoordinator.__params_to_release`` keyed by (coordinator, module, step)."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    parameter_offload.FWD_MODULE_STACK.clear()
    for method in vars(PartitionedParameterCoordinator).values():  # the cache sits inside instrument_w_nvtx
        for cached in [method, *(c.cell_contents for c in getattr(method, "__closure__", None) or ())]:
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()


def _disable_dropout(model) -> None:
    """No dropout in training (as TRL's ``disable_dropout``): dropout layers and HF attention's dropout rate."""
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def _memory_metrics(role: str) -> dict:
    """This rank's resident memory now and its peak so far, MB (``_max``: the group reports the largest rank), and
    the shared-memory pages counted in it: on the rank that puts weight buckets into Ray's object store, the store's
    pages it wrote (the store's memory, counted in this process's RSS too; the pool keeps the last push)."""
    import psutil

    return {f"memory/{role}_rss_mb_max": psutil.Process().memory_info().rss / 2**20,
            f"memory/{role}_peak_rss_mb_max": peak_rss_mb(), f"memory/{role}_shmem_mb_max": _shmem_mb()}


def _shmem_mb() -> float:
    """``RssShmem`` of this process, MB (0 where /proc has no such line)."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) / 1024 for line in f if line.startswith("RssShmem:")), 0.0)
    except OSError:
        return 0.0


def _load_checkpoints_weights_only(engine) -> None:
    """DeepSpeed's torch checkpoint engine loads with ``weights_only=False`` (arbitrary unpickling). Load with
    ``weights_only=True`` instead, allowing only the plain DeepSpeed records its checkpoints contain."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    def load(path: str, map_location=None):
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            return torch.load(path, map_location=map_location, weights_only=True)

    engine.checkpoint_engine.load = load




def _concat(parts: list, shard: TrainBatch):
    """Per-micro-batch ``[b, T]`` results back into the shard's rows (filler micro-batches at the end dropped)."""
    import torch

    return torch.cat(parts)[: shard.size]


def lr_factor(step: int, kind: str, warmup: int, total: int, min_ratio: float) -> float:
    """The LR at optimizer step ``step`` (0-based) as a fraction of the peak: linear warmup over ``warmup`` steps
    (step i gets (i + 1) / warmup), then ``constant``, or ``linear`` / ``cosine`` decay to ``min_ratio`` at step
    ``total`` and ``min_ratio`` after it."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def lr_scheduler(optimizer, **schedule):
    """A torch LambdaLR of :func:`lr_factor` (DeepSpeed steps it at each optimizer step and checkpoints it)."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, functools.partial(_factor_of, schedule))


def _factor_of(schedule: dict, step: int) -> float:
    return lr_factor(step, **schedule)


def ds_config(micro_batch_size: int, grad_accum: int, world_size: int, zero_stage: int, lr: float,
              betas: tuple[float, float], weight_decay: float, warmup_steps: int, grad_clip: float,
              dtype: str) -> dict:
    """DeepSpeed config: torch AdamW (works on CPU and GPU), constant LR after linear warmup."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "zero_optimization": {"stage": zero_stage},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "weight_decay": weight_decay,
                                                  "torch_adam": True}},
        "gradient_clipping": grad_clip if grad_clip > 0 else 0.0,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if warmup_steps:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                           "warmup_num_steps": warmup_steps, "warmup_type": "linear"}}
    return cfg
