"""The typed specs a run's actors are built from, derived from the config (pure functions, no Ray): what an engine
serves (:class:`workers.rollout.EngineSpec`), what a learner group trains (:class:`learner.worker.LearnerSpec`),
and what fixes an actor group's placement (a later run with the same key can load into the same actors)."""

from __future__ import annotations

import os

from common.actor_logs import actor_env
from learner.algorithms import critic_loss_kwargs
from learner.algorithms import loss_kwargs as policy_loss_kwargs
from learner.packing import Layout
from learner.worker import LearnerSpec, ds_config
from orchestrator.config import FleetConfig
from orchestrator.rl.rollout_source import source_class
from workers.prompts import read_chat_template
from workers.rollout import EngineSpec

FAULT_LEARNER_TEMPERATURE = "FLEETRL_FAULT_LEARNER_TEMPERATURE"
"""A test's injected fault: the learner scores at this temperature, whatever the engines sample at."""


def env_spec(cfg: FleetConfig) -> dict:
    """The ``env`` section as the rollout and env actors get it (a dict), with ``data.system_prompt``."""
    return {**cfg.env.model_dump(), "system_prompt": cfg.data.system_prompt}


def log_env(cfg: FleetConfig) -> dict[str, str]:
    """Environment variables that send an actor's output to ``<run.dir>/logs/<its name>.log``."""
    from pathlib import Path

    return actor_env(str(Path(cfg.run.dir) / "logs"), cfg.run.verbose)


def engine_spec(cfg: FleetConfig, max_model_len: int, index: int = 0) -> EngineSpec:
    """What engine ``index`` of ``cfg``'s rollout pool serves (its seed: ``rollout.seed + index``)."""
    r, lora, d = cfg.rollout, cfg.learner.lora, cfg.data
    return EngineSpec(cfg.model.path, cfg.engine_dtype, max_model_len, r.kv_cache_gib, r.seed + index,
                      r.gpu_memory_utilization, r.tensor_parallel_size, enforce_eager=r.enforce_eager,
                      prompt_format=d.prompt_format, system_prompt=d.system_prompt, stop=tuple(r.stop),
                      chat_template=read_chat_template(d.chat_template) if d.chat_template else None,
                      chat_template_kwargs=d.chat_template_kwargs or None,
                      partial_push=lora.enabled and lora.push == "merged", lora=lora.engine_spec(),
                      trust_remote_code=cfg.model.trust_remote_code)


def engine_threads(cfg: FleetConfig) -> int:
    """The torch threads of each CPU engine (``rollout.cpu_threads``, see there)."""
    r = cfg.rollout
    if r.cpu_threads:
        return r.cpu_threads
    if r.num_gpus or source_class(cfg).overlaps_learner:
        return 1
    return max(1, (os.cpu_count() or 1) // r.num_workers)


def learner_spec(cfg: FleetConfig, role: str = "actor") -> LearnerSpec:
    """What the ``role`` group (``actor`` or ``critic``) of ``cfg`` trains: model, DeepSpeed config, loss, layout."""
    lc = cfg.learner
    lr = cfg.algorithm.critic_lr if role == "critic" else lc.lr
    loss_kwargs = critic_loss_kwargs(cfg.algorithm) if role == "critic" else policy_loss_kwargs(cfg.algorithm)
    gas = cfg.micro_batches_per_rank()
    micro = (cfg.sequences_per_step // (lc.num_ranks * lc.num_minibatches)) // gas
    decays = lc.lr_schedule != "constant"  # then the warmup is the schedule's too, not DeepSpeed's WarmupLR
    dsc = ds_config(micro, gas, lc.num_ranks, lc.zero_stage, lr, lc.betas, lc.weight_decay,
                    0 if decays else lc.warmup_steps, lc.grad_clip, cfg.model.dtype)
    return LearnerSpec(cfg.model.path, cfg.model.dtype, dsc, loss_kwargs, learner_temperature(cfg), cfg.trainer.seed,
                       lc.gradient_checkpointing, role, cfg.uses_reference, lc.mixed_precision, learner_layout(cfg),
                       lc.lora.spec() if role == "actor" or lc.lora.critic else None, load_kwargs(cfg),
                       lr_schedule(cfg) if decays else None, cfg.engine_dtype if role == "actor" else None)


def lr_schedule(cfg: FleetConfig) -> dict:
    """:func:`learner.worker.lr_factor`'s keywords for ``learner.lr_schedule`` over the run's optimizer steps."""
    lc = cfg.learner
    return {"kind": lc.lr_schedule, "warmup": lc.warmup_steps, "min_ratio": lc.min_lr_ratio,
            "total": cfg.trainer.total_steps * lc.num_minibatches * lc.epochs}


def load_kwargs(cfg: FleetConfig) -> dict:
    """transformers' ``from_pretrained`` arguments of ``model.trust_remote_code`` and ``model.attn_implementation``
    (only those set, so a default config's learner spec is unchanged)."""
    m = cfg.model
    return {**({"trust_remote_code": True} if m.trust_remote_code else {}),
            **({"attn_implementation": m.attn_implementation} if m.attn_implementation else {})}


def placement_key(cfg: FleetConfig) -> tuple:
    """What fixes a learner group's actors (ranks, their resources, the rendezvous port, the threads): another run
    with the same key can load into them."""
    lc = cfg.learner
    return lc.num_ranks, lc.num_cpus, lc.num_gpus, tuple(sorted(lc.resources.items())), lc.master_port, \
        cfg.trainer.torch_threads


def learner_layout(cfg: FleetConfig) -> Layout:
    lc = cfg.learner
    return Layout(packing=lc.packing, chunk_tokens=lc.logprob_chunk_tokens, micro_batch_tokens=lc.micro_batch_tokens,
                  entropy=lc.log_entropy)


def learner_temperature(cfg: FleetConfig) -> float:
    """The temperature the learner divides logits by: the sampling one for policy gradients (their ratio is to
    the policy that sampled), 1 for SFT, DPO and PRM training (the model's own likelihoods). A test injects a
    mismatch with the driver's ``FLEETRL_FAULT_LEARNER_TEMPERATURE`` (tests/test_doctor.py)."""
    if os.environ.get(FAULT_LEARNER_TEMPERATURE):
        return float(os.environ[FAULT_LEARNER_TEMPERATURE])
    return cfg.rollout.temperature if cfg.algorithm.sampling_temperature_logprobs else 1.0
