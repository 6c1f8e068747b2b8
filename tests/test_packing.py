"""The memory-safe learner path equals the naive one: chunked logprobs/entropy vs a full log-softmax, packed rows vs
the padded layout, token-budget micro-batches vs one micro-batch (values and gradients, to 1e-5). Real
transformers models (tiny, random), no DeepSpeed."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

from learner.batch import build_batch
from learner.forward import HiddenStatesLM, critic_values, policy_logprobs
from learner.logprobs import naive_token_logprobs, token_logprobs
from learner.losses import policy_loss
from learner.packing import (
    Layout,
    layout_cost,
    micro_batches,
    pack_rows,
    packed_input,
    padded_input,
    plan_micro_batches,
)

PAD = 3  # a real token id: nothing may depend on it


def _config(vocab=300, **kw):
    return LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=True, attn_implementation="sdpa", **kw)


def _model(vocab=300):
    torch.manual_seed(0)
    return HiddenStatesLM(LlamaForCausalLM(_config(vocab)).double())


def _batch(vocab=300, rows=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    comps = [torch.randint(4, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
             for _ in range(rows)]
    batch = build_batch(prompts, comps, [[0.0] * len(c) for c in comps], PAD).with_scale()
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g, dtype=torch.float64) * batch.response_mask
    return batch


def test_chunked_logprobs_equal_the_full_log_softmax_with_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 5000, bias=False).double()
    hidden = torch.randn(70, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5000, (70,))
    lp, ent = token_logprobs(head, hidden, targets, temperature=0.7, chunk=16)
    (lp.sum() + 0.3 * ent.sum()).backward()
    g_chunked, w_chunked = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    lp0, ent0 = naive_token_logprobs(head(hidden), targets, temperature=0.7)
    (lp0.sum() + 0.3 * ent0.sum()).backward()
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent0, atol=1e-5, rtol=0)
    torch.testing.assert_close(g_chunked, hidden.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(w_chunked, head.weight.grad, atol=1e-5, rtol=0)


def test_packed_rows_restart_positions_and_score_only_response_tokens():
    batch = _batch()
    x = packed_input(batch)
    lengths = batch.attention_mask.sum(-1)
    rows, width = x.input_ids.shape
    assert width == int(lengths.max()) and rows < batch.size and x.attention_mask is None
    # every sample's real tokens appear once, whole, starting at a position-0 restart
    assert batch.size <= int((x.position_ids == 0).sum()) <= batch.size + rows  # a restart per sample (+ tails)
    assert x.scored.targets.numel() == int(batch.response_mask.sum())
    # the position before each scored token holds that token's predecessor in the packed rows
    assert torch.equal(x.input_ids.reshape(-1)[x.scored.hidden_index + 1], x.scored.targets)


def _lengths_batch(lengths: list[int], prompt: int = 4):
    return build_batch([[5] * min(prompt, n - 1) for n in lengths], [[6] * (n - min(prompt, n - 1)) for n in lengths],
                       [[0.0] * (n - min(prompt, n - 1)) for n in lengths], PAD)


@pytest.mark.parametrize("mix", ["equal", "skewed", "outlier", "random"])
def test_the_packed_layout_never_costs_more_than_padding(mix):
    """Positions through the matmuls and attention cells of the packed layout <= the padded layout's, for
    equal, skewed, one-long-outlier and random mixes of lengths (the cost grows with a row's square on CPU)."""
    g = torch.Generator().manual_seed(hash(mix) % 1000)
    for trial in range(20):
        b = int(torch.randint(1, 33, (1,), generator=g))
        if mix == "equal":
            lengths = [int(torch.randint(2, 300, (1,), generator=g))] * b
        elif mix == "skewed":
            lengths = sorted(int(x) for x in (torch.rand(b, generator=g) ** 3 * 400 + 2))
        elif mix == "outlier":
            lengths = [int(torch.randint(2, 20, (1,), generator=g)) for _ in range(b - 1)] + [500]
        else:
            lengths = [int(x) for x in torch.randint(2, 400, (b,), generator=g)]
        batch = _lengths_batch(lengths)
        packed, padded = layout_cost(packed_input(batch)), layout_cost(padded_input(batch))
        assert packed[0] <= padded[0] and packed[1] <= padded[1], (mix, trial, lengths, packed, padded)
    assert layout_cost(packed_input(_lengths_batch([100] * 8))) == layout_cost(padded_input(_lengths_batch([100] * 8)))


def test_first_fit_decreasing_rows():
    assert pack_rows([5, 3, 2, 5], 5) == [[0], [3], [1, 2]]
    assert pack_rows([9, 1, 1], 5) == [[0], [1, 2]]  # a sample over the cap gets a row of its own
    assert sorted(i for row in pack_rows([3, 4, 1, 2, 6, 2], 6) for i in row) == list(range(6))


def _loss_and_grads(model, mbs, layout):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in mbs:
        logp, ent = policy_logprobs(model, mb, layout, temperature=0.9)
        loss, _ = policy_loss(logp, logp.detach(), mb.advantages, mb.response_mask, mb.scale, entropy=ent,
                              entropy_coef=0.01)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}, logp, ent


@pytest.mark.parametrize("budget", [None, 25])
def test_packed_chunked_token_budget_equals_padded_naive(budget):
    model, batch = _model(), _batch()
    naive = Layout(packing=False, chunk_tokens=0)
    loss0, grads0, *_ = _loss_and_grads(model, [batch], naive)
    fast = Layout(packing=True, chunk_tokens=7, micro_batch_tokens=budget)
    mbs = micro_batches(batch, batch.size, budget)
    assert len(mbs) == (1 if budget is None else len(plan_micro_batches(batch.attention_mask.sum(-1).tolist(), 25)))
    loss1, grads1, *_ = _loss_and_grads(model, mbs, fast)
    assert loss1 == pytest.approx(loss0, abs=1e-5)
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, atol=1e-5, rtol=0, msg=name)


def test_packed_logprobs_and_entropy_equal_padded_per_token():
    model, batch = _model(), _batch()
    with torch.no_grad():
        lp0, ent0 = policy_logprobs(model, batch, Layout(packing=False, chunk_tokens=0))
        lp1, ent1 = policy_logprobs(model, batch, Layout(packing=True, chunk_tokens=5))
        lp2, none = policy_logprobs(model, batch, Layout(packing=True, chunk_tokens=5), with_entropy=False)
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0 * batch.response_mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp2, lp0, atol=1e-5, rtol=0)
    assert none is None


def test_critic_values_packed_equal_padded():
    torch.manual_seed(0)
    critic = LlamaForTokenClassification(_config(num_labels=1)).double().eval()
    batch = _batch()
    with torch.no_grad():
        v0 = critic_values(critic, batch, Layout(packing=False))
        v1 = critic_values(critic, batch, Layout(packing=True))
        # the plain padded forward: V at the position before each response token
        attn = batch.attention_mask
        out = critic(input_ids=batch.input_ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0))
        direct = (out.logits[:, batch.prompt_len - 1: -1, 0] * batch.response_mask).float()
    torch.testing.assert_close(v0, direct, atol=1e-6, rtol=0)
    torch.testing.assert_close(v1, direct, atol=1e-6, rtol=0)
    assert v0.abs().sum() > 0


def test_token_budget_plan_and_filler_micro_batches():
    assert plan_micro_batches([5, 5, 5, 20, 3], 10) == [[0, 1], [2], [3], [4]]
    batch = _batch()
    mbs = micro_batches(batch, 2, None, count=5)
    assert [mb.size for mb in mbs] == [2, 2, 2, 1, 1]
    assert mbs[-1].response_mask.sum() == 0 and mbs[-2].response_mask.sum() == 0
