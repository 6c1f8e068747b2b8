"""One GRPO update on the same batch through TRL 1.16's `GRPOTrainer` and through fleetrl's learner path, at equal
settings (fp32, no KL, token-level loss = TRL's "dapo", group-std advantages, clip 0.2, AdamW, grad-norm clip 1):
the advantages, the loss, the gradient and the parameters after one optimizer step agree. (TRL's config turns
bf16 autocast on by default; at its default the two differ by up to 0.04 in the sampled tokens' logprobs.)

TRL generates and scores the batch itself (its `_generate_and_score_completions`, transformers `generate` on the
embedded arithmetic model with noise added, so completions differ in length) and trains one real step
(`trainer.train()`); fleetrl's side takes that batch's token ids and rewards and runs what a learner rank runs:
`build_batch`, the packed forward with the chunked LM head (`learner.forward.policy_logprobs`), the registered
`policy` loss with the config's settings, torch AdamW with DeepSpeed's settings (eps 1e-8) after clipping the
gradient norm to 1. The one deliberate difference: TRL adds 1e-4 to the group std, fleetrl `algorithm.eps` (1e-6 by
default); the test sets fleetrl's to TRL's."""

import copy

import pytest
import torch

from bench.trl_grpo import build_dataset
from learner.algorithms import advantage_inputs, assemble_advantages, loss_kwargs
from learner.batch import build_batch
from learner.forward import HiddenStatesLM, policy_logprobs
from learner.losses import call_loss
from orchestrator.config import load_config
from orchestrator.rl.specs import learner_layout
from tests.test_stream import _perturbed_copy

P, G, LR = 4, 4, 1e-3


def ones(prompts: list, completions: list, **_) -> list[float]:
    """A reward that varies within every group of the noisy policy's samples: the number of 1s it wrote."""
    return [float(c.count("1")) for c in completions]


def _trl_step(model, tok, tmp_path):
    """TRL's trainer after one real training step on a batch it generated and scored, that batch, and the gradient
    of TRL's loss on it at the starting weights."""
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=P * G, gradient_accumulation_steps=1,
        num_generations=G, max_completion_length=8, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
        temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo", scale_rewards="group", max_steps=1, seed=3,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, fp16=False, shuffle_dataset=False,
        disable_dropout=True, remove_unused_columns=False, disable_tqdm=True, logging_steps=1)
    data = build_dataset(1, P, 0)
    trainer = GRPOTrainer(model=model, reward_funcs=ones, args=args, train_dataset=data,
                          processing_class=tok)
    set_seed(3)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([data[i // G] for i in range(P * G)])
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its first step

    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])
    trainer.model.zero_grad()
    trainer._generate_and_score_completions = lambda *a, **kw: batch  # the step trains on this batch
    trainer.train()
    return trainer, batch, loss.item(), grad


def test_one_grpo_update_on_the_same_batch_equals_trls(tmp_path, embedded_model):
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = _perturbed_copy(embedded_model, tmp_path / "model")  # samples of many lengths (up to the cap)
    tok = AutoTokenizer.from_pretrained(model)
    start = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer, trl_batch, trl_loss, g_trl = _trl_step(copy.deepcopy(start), tok, tmp_path / "trl")
    rows = [trl_batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    prompts = [ids[m == 1].tolist() for ids, m in zip(rows[0], rows[1])]
    completions = [ids[m == 1].tolist() for ids, m in zip(rows[2], rows[3])]
    texts = tok.batch_decode([c for c in completions], skip_special_tokens=True)
    rewards = ones([], texts)
    assert len(set(rewards)) > 1 and len({len(c) for c in completions}) > 1  # signal, and lengths that differ

    cfg = load_config(None, ["algorithm.eps=1e-4", "algorithm.tis_cap=null"])
    batch = build_batch(prompts, completions, [[0.0] * len(c) for c in completions], tok.pad_token_id).with_scale()
    inputs = advantage_inputs(rewards, [{}] * len(rewards), [str(i // G) for i in range(P * G)],
                              batch.response_mask)
    adv, _ = assemble_advantages(cfg.algorithm, inputs)
    per_seq = adv.sum(-1) / batch.response_mask.sum(-1)
    assert torch.allclose(per_seq, trl_batch["advantages"], atol=1e-6), (per_seq, trl_batch["advantages"])
    batch.advantages = adv

    # the gradient of each side's loss at the starting weights
    ours = copy.deepcopy(start).train()
    lm = HiddenStatesLM(ours)
    logp, entropy = policy_logprobs(lm, batch, learner_layout(cfg), temperature=1.0)
    settings = loss_kwargs(cfg.algorithm)
    inputs = {"logp": logp, "old_logp": logp.detach(), "advantages": batch.advantages, "mask": batch.response_mask,
              "scale": batch.scale, "entropy": entropy}
    loss, _ = call_loss(settings.pop("objective"), inputs, settings)
    loss.backward()
    g_ours = torch.cat([p.grad.flatten() for p in ours.parameters()])
    cosine = torch.nn.functional.cosine_similarity(g_ours.double(), g_trl.double(), dim=0).item()
    print(f"loss fleetrl {loss.item():.8f} TRL {trl_loss:.8f}; grad norm {g_ours.norm():.6f} vs "
          f"{g_trl.norm():.6f}, cosine {cosine:.8f}")
    assert loss.item() == pytest.approx(trl_loss, abs=1e-6)
    assert g_ours.norm().item() == pytest.approx(g_trl.norm().item(), rel=1e-5) and cosine > 1 - 1e-6

    # one optimizer step as a learner rank takes it (DeepSpeed: clip the norm to learner.grad_clip, torch AdamW)
    torch.nn.utils.clip_grad_norm_(ours.parameters(), cfg.learner.grad_clip)
    opt = torch.optim.AdamW(ours.parameters(), lr=LR, betas=cfg.learner.betas, eps=1e-8,
                            weight_decay=cfg.learner.weight_decay)
    opt.step()
    before, after_trl, after_ours = (dict(m.named_parameters()) for m in (start, trainer.model, ours))
    d_trl = torch.cat([(after_trl[k] - before[k]).detach().flatten() for k in before]).double()
    d_ours = torch.cat([(after_ours[k] - before[k]).detach().flatten() for k in before]).double()
    gap = (d_ours - d_trl).abs()
    clear = g_trl.double().abs() > 1e-6  # gradients well above Adam's eps (1e-8)
    update_cosine = torch.nn.functional.cosine_similarity(d_ours, d_trl, dim=0).item()
    print(f"one optimizer step: update cosine {update_cosine:.10f}; max |fleetrl - TRL| {gap[clear].max():.2e} where "
          f"|grad| > 1e-6 ({float(clear.double().mean()):.1%} of the parameters), {gap.max():.2e} anywhere (at a "
          f"gradient of {g_trl.double().abs()[gap.argmax()]:.1e}, where Adam's eps makes the step sensitive to "
          f"rounding); largest update {d_trl.abs().max():.2e}")
    assert d_trl.abs().max() > 0.5 * LR and update_cosine > 1 - 1e-6
    assert gap[clear].max() < 1e-3 * LR and gap.max() < 0.05 * LR  # 1e-6: a few float32 steps of a weight near 1
