"""LoRA on the policy (learner.lora): a real LearnerWorker rank (DeepSpeed, gloo, one rank in this process) on a
small Qwen2 model with PEFT adapters, and one short run of the real stack with the merged push. Exact resume, the
adapter push and the exports loading in vLLM are guarded by tests/test_resume.py's LoRA mode."""

import subprocess
import sys

import pytest
import torch

from orchestrator.config import ConfigError, load_config
from tests.test_e2e import ROOT, run_fleetrl

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from orchestrator.models.embedded_model import build_model, build_tokenizer

    out = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer()
    build_model(len(tok), seed=0).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def worker(model_dir):
    """One LoRA learner rank (world size 1, ZeRO-2, a KL reference) and the batch it trains on."""
    from bench.learner_overhead import make_batch
    from learner.worker import ds_config

    w = _rank(model_dir, ds_config(8, 1, 1, 2, 1e-2, (0.9, 0.999), 0.0, 0, 1.0, "float32"), LORA)
    batch = make_batch(w.hf_model.config.vocab_size, 8, 6)
    yield w, batch
    torch.distributed.destroy_process_group()


def _rank(model_dir: str, dsc: dict, lora: dict | None, role: str = "actor"):
    """A fresh learner rank (world size 1, seed 0, GRPO with a KL reference; ``role="critic"``: PPO's critic)
    under DeepSpeed config ``dsc``."""
    from common.net import free_port
    from learner.algorithms import critic_loss_kwargs, loss_kwargs
    from learner.worker import LearnerSpec, LearnerWorker
    from orchestrator.rl.specs import learner_layout

    algo = "ppo" if role == "critic" else "grpo"
    cfg = load_config(overrides=[f"model.path={model_dir}", f"algorithm.name={algo}", "algorithm.kl_coef=0.01"])
    kwargs = critic_loss_kwargs(cfg.algorithm) if role == "critic" else loss_kwargs(cfg.algorithm)
    spec = LearnerSpec(model_dir, "float32", dsc, kwargs, 1.0, 0, role=role, reference=role == "actor",
                       layout=learner_layout(cfg), lora=lora)
    return LearnerWorker(0, 1, "127.0.0.1", free_port(), spec, 1)


def test_a_lora_critic_trains_its_adapters_and_value_head_only(model_dir, process_group, tmp_path):
    """``learner.lora.critic``: PPO's critic with its own adapters on a frozen base. Before any update its values
    equal the full-weight critic's exactly (B = 0, the same fresh head); an update moves only its adapters and its
    value head (the optimizer holds nothing else), and its checkpoint holds just those tensors."""
    from bench.learner_overhead import make_batch
    from learner.worker import ds_config

    dsc = ds_config(8, 1, 1, 2, 1e-2, (0.9, 0.999), 0.0, 0, 1.0, "float32")
    full = _rank(model_dir, dsc, None, role="critic")
    batch = make_batch(full.hf_model.config.vocab_size, 8, 6)
    batch.old_values = torch.zeros_like(batch.advantages)
    g = torch.Generator().manual_seed(1)
    batch.returns = torch.randn(batch.advantages.shape, generator=g) * batch.response_mask
    full_values = full.compute_values(batch, 8)
    w = _rank(model_dir, dsc, LORA, role="critic")
    assert torch.equal(w.compute_values(batch, 8), full_values)
    trainable = {n for n, p in w.hf_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "score.modules_to_save." in n for n in trainable)
    assert any("score.modules_to_save." in n for n in trainable) and any(".lora_B." in n for n in trainable)
    assert {id(p) for g in w.engine.optimizer.bit16_groups for p in g} == \
        {id(p) for p in w.hf_model.parameters() if p.requires_grad}
    before = _snapshot(w.hf_model)
    w.train([batch.with_scale()], 1, 8)
    after = _snapshot(w.hf_model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= trainable and any("score.modules_to_save." in n for n in changed)
    assert not torch.equal(w.compute_values(batch, 8), full_values)
    w.save_checkpoint(str(tmp_path / "ckpt"))
    states = list((tmp_path / "ckpt" / "ds").glob("mp_rank_*_model_states.pt"))
    state = torch.load(states[0], map_location="cpu", weights_only=False)
    assert set(state["module"]) == trainable, sorted(set(state["module"]) ^ trainable)
    assert not state.get("frozen_param_fragments")  # nor the frozen base beside it


def _snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_only_adapters_train_and_the_reference_is_the_base(worker):
    """Only lora_A/lora_B are trainable and in the optimizer; before any update the reference (adapters off)
    gives exactly the policy's logprobs; an update moves the adapters and leaves every base tensor as it was."""
    w, batch = worker
    trainable = {n for n, p in w.hf_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    adapters = [p for p in w.hf_model.parameters() if p.requires_grad]
    # ZeRO-2 keeps the parameters it optimizes in bit16_groups and their AdamW state in flat fp32 partitions
    assert {id(p) for g in w.engine.optimizer.bit16_groups for p in g} == {id(p) for p in adapters}

    first = w.compute_logprobs(batch, 8)
    assert torch.equal(first["ref_logprobs"], first["old_logprobs"])  # B starts at zero: the policy is the base

    before = _snapshot(w.hf_model)
    w.train([batch], 1, 8)
    after = _snapshot(w.hf_model)
    moments = [s["exp_avg"] for s in w.engine.optimizer.optimizer.state.values()]
    assert sum(m.numel() for m in moments) == sum(p.numel() for p in adapters)  # no AdamW state for the base
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= trainable
    assert any(".lora_B." in n for n in changed)
    second = w.compute_logprobs(batch, 8)
    assert torch.equal(second["ref_logprobs"], first["ref_logprobs"])  # the reference did not move
    assert (second["old_logprobs"] - first["old_logprobs"]).abs().max() > 1e-4  # the policy did


def test_a_learner_rank_builds_no_deepspeed_op(worker):
    """The rank's DeepSpeed comm backend runs without the CPU shared-memory all-reduce op, whose JIT build a fresh
    machine would pay (94 s on 2 cores) for inference-only collectives: gloo carries ZeRO's."""
    import deepspeed

    assert deepspeed.comm.comm.cdb.shm_comm_op is None
    assert deepspeed.comm.get_world_size() == 1 and deepspeed.comm.comm.cdb.name == "torch"


def test_push_sends_merged_adapted_weights_under_base_names(worker, model_dir):
    """The push's tensors are the adapted layers' weights under the base model's names, equal to W + s*B*A, and
    nothing else (untouched tensors are not resent)."""
    from safetensors.torch import load_file

    w, _ = worker
    base = load_file(f"{model_dir}/model.safetensors")
    specs = w.weight_specs()
    names = [n for n, _, _ in specs]
    assert names and set(names) < set(base)  # a subset of the base checkpoint's names
    assert not any("embed_tokens" in n or "norm" in n for n in names)
    pushed = {n: t.clone() for plan, chunk in w._gathered(64) for n, t in zip(plan.names, chunk)}
    q = "model.layers.0.self_attn.q_proj"
    layer = w.hf_model.get_submodule(q)
    expected = base[f"{q}.weight"] + layer.scaling["default"] * layer.lora_B["default"].weight @ \
        layer.lora_A["default"].weight
    assert torch.allclose(pushed[f"{q}.weight"], expected, atol=1e-6)
    assert not torch.equal(pushed[f"{q}.weight"], base[f"{q}.weight"])  # the trained adapter is in it


def test_saved_policy_is_merged_and_adapter_loads_in_peft(worker, model_dir, tmp_path):
    """save_hf writes the merged model (transformers logprobs = the learner's adapter-on logprobs, not the base's)
    and adapter/ in PEFT's format (the base + that adapter gives the same logprobs)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    w, batch = worker
    out = w.save_hf(str(tmp_path / "policy"))
    ids = batch.input_ids[:1][:, batch.attention_mask[0].bool()]  # one row, padding dropped
    with torch.no_grad():
        learner = w.hf_model(input_ids=ids).logits.log_softmax(-1)
        merged = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits.log_softmax(-1)
        base_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        base = base_model(input_ids=ids).logits.log_softmax(-1)
        adapted = PeftModel.from_pretrained(base_model, f"{out}/adapter").eval()(input_ids=ids).logits.log_softmax(-1)
    assert (merged - learner).abs().max() <= 1e-4
    assert (adapted - learner).abs().max() <= 1e-4
    assert (merged - base).abs().max() > 1e-3


def test_adapter_push_is_what_peft_saves_and_loads(worker, model_dir, tmp_path):
    """push: adapter sends the adapter tensors under PEFT's own names (those of its saved adapter), and the
    directory an engine writes from them loads in PEFT with the learner's logprobs."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from learner.lora import adapter_weights
    from workers.lora_adapters import write_adapter

    w, batch = worker
    pushed = {n: t.detach().clone() for n, t in adapter_weights(w.hf_model).items()}
    w.peft.save_pretrained(str(tmp_path / "peft"))
    saved = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert set(pushed) == set(saved) and all(torch.equal(pushed[n], saved[n]) for n in saved)
    path = write_adapter(pushed, {"rank": LORA["rank"], "alpha": LORA["alpha"]}, tmp_path / "engine")
    ids = batch.input_ids[:1][:, batch.attention_mask[0].bool()]
    with torch.no_grad():
        learner = w.hf_model(input_ids=ids).logits.log_softmax(-1)
        base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        served = PeftModel.from_pretrained(base, str(path)).eval()(input_ids=ids).logits.log_softmax(-1)
    assert (served - learner).abs().max() <= 1e-5


def test_checkpoint_holds_the_adapter_not_the_base(worker, tmp_path):
    """A LoRA checkpoint's module state is the adapter tensors only (the frozen base is the model path's)."""
    w, _ = worker
    w.save_checkpoint(str(tmp_path / "ckpt"))
    states = list((tmp_path / "ckpt" / "ds").glob("mp_rank_*_model_states.pt"))
    assert states
    state = torch.load(states[0], map_location="cpu", weights_only=False)
    module = state["module"]
    assert module and all("lora_" in n for n in module), [n for n in module if "lora_" not in n]
    assert not state.get("frozen_param_fragments")  # ZeRO-2 would add every frozen tensor here


def _sgd_rank(model_dir: str, zero_stage: int, lora: dict | None):
    """A fresh rank (world size 1, seed 0) training with plain SGD, lr 10: its update is -10 x the gradient, so
    equal updates mean equal gradients (AdamW's first step, ~ -lr * sign(g), magnifies float rounding)."""
    from learner.worker import ds_config

    dsc = ds_config(8, 1, 1, zero_stage, 10.0, (0.9, 0.999), 0.0, 0, 1.0, "float32")
    dsc["optimizer"] = {"type": "SGD", "params": {"lr": 10.0}}
    dsc["zero_allow_untested_optimizer"] = True
    # every tensor partitioned and released after use, as a real model's embedding is (the tiny model's would
    # otherwise be under DeepSpeed's persistence threshold)
    dsc["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return _rank(model_dir, dsc, lora)


def _full_snapshot(model) -> dict:
    """Every parameter, whole (gathered from its ZeRO-3 partition)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return _snapshot(model)


@pytest.fixture(scope="module")
def process_group():
    """The ranks built by a test share this process's gloo group (DeepSpeed caches it), kept to the end of the
    module and destroyed then unless the ``worker`` fixture does."""
    initialized = torch.distributed.is_initialized()
    yield
    if not initialized and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("lora,untied", [(LORA, False), (None, False), (None, True)],
                         ids=["lora", "full", "full-untied"])
def test_zero3_trains_as_zero2(model_dir, process_group, tmp_path, lora, untied):
    """Under ZeRO-3 the LM head's weight (the tied input embedding, frozen with LoRA; or a head of its own) is
    partitioned, and the chunked head runs outside the engine's forward, its chunks recomputed in backward
    (:func:`learner.forward.head_function`). One update on the same batch: with LoRA only the adapters move; the
    reference equals the policy before it; the logprobs, gradient norm and update (the tied embedding's or the
    untied head's too, with full weights) equal ZeRO-2's."""
    from bench.learner_overhead import make_batch
    from tests.test_weight_sync import untied_copy

    path = str(untied_copy(tmp_path, model_dir)) if untied else model_dir  # the unit tier builds no embedded model
    runs = {}
    for stage in (2, 3):
        w = _sgd_rank(path, stage, lora)
        batch = make_batch(w.hf_model.config.vocab_size, 8, 6)
        first = w.compute_logprobs(batch, 8)
        before = _full_snapshot(w.hf_model)
        metrics = w.train([batch], 1, 8)
        runs[stage] = w, first, before, _full_snapshot(w.hf_model), metrics, w.compute_logprobs(batch, 8)
    w, first, before, after, metrics, second = runs[3]
    trainable = {n for n, p in w.hf_model.named_parameters() if p.requires_grad}
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert torch.equal(first["ref_logprobs"], first["old_logprobs"])  # LoRA: B starts at zero (the base)
    assert torch.equal(second["ref_logprobs"], first["ref_logprobs"])  # the reference did not move
    assert (second["old_logprobs"] - first["old_logprobs"]).abs().max() > 1e-4  # the policy did
    if lora:
        adapters = [p for p in w.hf_model.parameters() if p.requires_grad]
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
        assert {id(p) for g in w.engine.optimizer.fp16_groups for p in g} == {id(p) for p in adapters}
        assert changed and changed <= trainable and any(".lora_B." in n for n in changed)
    elif untied:
        assert "lm_head.weight" in changed  # the untied head's own gradient landed on its gathered parameter
    else:
        assert "model.embed_tokens.weight" in changed  # the tied head's gradient reached the embedding

    _, first2, before2, after2, metrics2, second2 = runs[2]
    assert (first["old_logprobs"] - first2["old_logprobs"]).abs().max() <= 1e-5
    assert abs(metrics["actor/grad_norm"] - metrics2["actor/grad_norm"]) <= 1e-6
    assert max((after[n] - before[n]).abs().max() for n in trainable) > 1e-3
    for n in before:
        assert torch.equal(before[n], before2[n]), n  # the same initial weights
        assert (after[n] - before[n] - (after2[n] - before2[n])).abs().max() <= 1e-6, n
    assert (second["old_logprobs"] - second2["old_logprobs"]).abs().max() <= 1e-5


@pytest.mark.parametrize("override, message", [
    ("learner.lora.rank=-1", "learner.lora.rank"),
    ("learner.lora.dropout=1.5", "learner.lora.dropout"),
    ("learner.lora.target_modules=[]", "learner.lora.target_modules"),
    ("learner.lora.push=delta", "learner.lora.push"),
    ("learner.lora.rank=600 learner.lora.push=adapter", "largest LoRA rank is 512"),
    ("algorithm.name=ppo learner.lora.critic=true", "learner.lora.critic: Value error, true adapts the critic"),
])
def test_bad_lora_settings_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(overrides=override.split())


def test_a_target_module_the_model_lacks_is_a_config_error(model_dir):
    with pytest.raises(ConfigError, match=r"learner\.lora\.target_modules: \['qkv'\] match no module"):
        load_config(overrides=[f"model.path={model_dir}", "learner.lora.rank=8", "learner.lora.target_modules=[qkv]"])
    load_config(overrides=[f"model.path={model_dir}", "learner.lora.rank=8",
                           "learner.lora.target_modules=[q_proj,v_proj]"])


def test_cli_bad_lora_rank_exits_2_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "orchestrator", "train", "learner.lora.rank=-3",
                        f"run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "learner.lora.rank" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
@pytest.mark.learner(ranks=2, zero_stage=3)
def test_merged_push_reaches_the_engines_every_step(tmp_path):
    """Only this test guards the merged push on vLLM, and LoRA under ZeRO-3 on the real stack (2 ranks, the
    adapted blocks gathered for the push, the chunked head's gathered weight): the engine reloads the adapted
    blocks alone (embeddings and norms not resent, q/k/v and gate/up fused by vLLM) and then samples exactly what
    the learner computes."""
    from safetensors import safe_open

    rows = run_fleetrl(tmp_path / "run", "trainer.total_steps=2", "trainer.eval_every=0", "rollout.num_workers=1",
                       "learner.num_ranks=2", "learner.zero_stage=3", "learner.lora.rank=8", "learner.lr=3e-3",
                       "learner.log_kl=true")
    pushes = [r for r in rows if "weight_sync/logprob_max_diff" in r]
    assert len(pushes) == 2 and all(r["weight_sync/logprob_max_diff"] < 1e-3 for r in pushes)
    assert rows[1]["kl"] > 0  # the policy moved away from the reference (the base, adapters off)
    with safe_open(str(ROOT / ".fleetrl/models/arith-base/model.safetensors"), "pt") as f:
        full = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    assert 0 < pushes[0]["weight_sync/bytes"] < full

