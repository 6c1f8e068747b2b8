"""Losses: PPO clip cases, KL estimators, aggregation, and invariance to micro-batch/rank splits."""

import pytest
import torch

from learner.batch import TrainBatch, build_batch
from learner.losses import LOSSES, LossScale, aggregate, kl_estimate, policy_loss, value_loss


def _scale(mask):
    return LossScale(num_seqs=mask.shape[0], num_tokens=int(mask.sum()), max_len=mask.shape[1])


@pytest.mark.parametrize(
    "adv,ratio,grad_flows",
    [(1.0, 1.1, True), (1.0, 1.3, False), (-1.0, 0.9, True), (-1.0, 0.7, False), (-1.0, 1.3, True), (1.0, 0.7, True)],
)
def test_ppo_clip_four_cases(adv, ratio, grad_flows):
    """A>0 and r>1+eps, or A<0 and r<1-eps, is clipped (no gradient); otherwise the gradient flows."""
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), float(torch.log(torch.tensor(ratio))), requires_grad=True)
    mask = torch.ones(1, 1)
    loss, m = policy_loss(logp, old, torch.full((1, 1), adv), mask, _scale(mask), clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert (logp.grad.abs().item() > 0) == grad_flows
    expected = -min(ratio * adv, max(min(ratio, 1.2), 0.8) * adv)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["actor/clip_frac"].item() == (0.0 if grad_flows else 1.0)


def test_clip_higher_and_dual_clip():
    old, mask = torch.zeros(1, 1), torch.ones(1, 1)
    lp = torch.log(torch.tensor([[1.25]]))
    loss, _ = policy_loss(lp, old, torch.ones(1, 1), mask, _scale(mask), clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.25)  # within 1 + 0.28: not clipped
    lp = torch.log(torch.tensor([[10.0]]))
    loss, _ = policy_loss(lp, old, -torch.ones(1, 1), mask, _scale(mask), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)  # capped at -c * A


def test_kl_estimators_match_true_kl_of_categoricals():
    """k1 and k3 are unbiased for KL(p || q) when tokens are sampled from p; k3 is >= 0 everywhere."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6), 0)
    q = torch.softmax(torch.randn(6), 0)
    true_kl = (p * (p / q).log()).sum()
    x = torch.multinomial(p, 400_000, replacement=True)
    logp, logq = p.log()[x], q.log()[x]
    for kind in ("k1", "k3"):
        assert kl_estimate(logp, logq, kind).mean().item() == pytest.approx(true_kl.item(), rel=0.02)
    assert torch.all(kl_estimate(logp, logq, "k3") >= 0)
    assert torch.allclose(kl_estimate(logp, logq, "k2"), 0.5 * (logp - logq) ** 2)


def test_aggregation_modes():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    s = _scale(mask)
    assert aggregate(v, mask, "token_mean", s).item() == pytest.approx(10 / 4)
    assert aggregate(v, mask, "seq_mean_token_mean", s).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(v, mask, "seq_mean_token_sum", s).item() == pytest.approx(10 / 2)
    assert aggregate(v, mask, "seq_mean_token_sum_norm", s).item() == pytest.approx(10 / 6)


def _random_batch(seed, B=12, T=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    logp = (-torch.rand(B, T, generator=g) * 2).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    ref = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                         "seq_mean_token_sum_norm"])
def test_loss_and_gradient_invariant_to_micro_batch_split(aggregation):
    logp, old, ref, adv, mask = _random_batch(0)
    scale = _scale(mask)
    kw = dict(aggregation=aggregation, kl_coef=0.1, entropy_coef=0.0)
    whole, _ = policy_loss(logp, old, adv, mask, scale, ref_logp=ref, **kw)
    (g_whole,) = torch.autograd.grad(whole, logp)
    parts, g_parts = 0.0, torch.zeros_like(logp)
    for rows in (slice(0, 5), slice(5, 6), slice(6, 12)):  # uneven micro-batches, same global scale
        loss, _ = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], scale, ref_logp=ref[rows], **kw)
        (g,) = torch.autograd.grad(loss, logp)
        parts += loss.item()
        g_parts += g
    assert parts == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(g_parts, g_whole, atol=1e-7)


def test_sequence_level_ratio_gspo():
    logp, old, _, adv, mask = _random_batch(1)
    loss, m = policy_loss(logp, old, adv, mask, _scale(mask), ratio_level="sequence")
    seq_ratio = (((logp - old) * mask).sum(-1) / mask.sum(-1)).exp()
    tok_ratio_mean = (seq_ratio[:, None] * mask).sum() / mask.sum()
    assert m["actor/ratio_mean"].item() == pytest.approx(tok_ratio_mean.item(), rel=1e-5)
    assert torch.isfinite(loss)


def test_truncated_importance_sampling_caps_weights():
    mask = torch.ones(1, 2)
    logp = torch.zeros(1, 2)
    rollout = torch.tensor([[-5.0, 0.0]])  # token 0: pi_old / pi_rollout = e^5, capped at 2
    loss, _ = policy_loss(logp, logp, torch.ones(1, 2), mask, _scale(mask), rollout_logp=rollout, tis_cap=2.0)
    assert loss.item() == pytest.approx(-(2.0 + 1.0) / 2)


def test_clipped_value_loss():
    v, old, ret, mask = torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1)
    loss, m = value_loss(v, old, ret, mask, _scale(mask), clip=0.2)
    assert loss.item() == pytest.approx(0.5 * max(1.0, (0.2 - 2.0) ** 2))
    assert m["critic/clip_frac"].item() == 1.0
    assert set(LOSSES) >= {"policy", "value", "sft"}


def test_build_batch_layout_left_prompt_right_response():
    b: TrainBatch = build_batch([[5, 6], [7]], [[8, 9, 1], [4]], [[-0.1, -0.2, -0.3], [-0.4]], pad_id=0)
    assert b.prompt_len == 2
    assert b.input_ids.tolist() == [[5, 6, 8, 9, 1], [0, 7, 4, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert b.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.rollout_logprobs[1].tolist() == pytest.approx([-0.4, 0, 0])
    shards = b.with_scale().shards(2)
    assert [s.size for s in shards] == [1, 1] and shards[1].scale.num_tokens == 4


def test_weight_bucket_round_trip_all_dtypes():
    from workers.weight_buckets import from_object, param_specs, plan_buckets, to_object

    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.arange(7)),
             ("d", torch.randn(2, 3).t())]  # non-contiguous
    (plan,) = plan_buckets(param_specs(named), cap_bytes=10**6)
    out = from_object(to_object(plan, [t for _, t in named]))
    assert [n for n, _ in out] == ["a", "b", "c", "d"]
    for (_, x), (_, y) in zip(named, out):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                         "seq_mean_token_sum_norm"])
def test_masked_positions_of_an_episode_get_exactly_zero_gradient(aggregation):
    """A multi-turn episode's observation tokens (loss mask 0 between sampled turns): the policy loss with every
    term on (clip, KL, entropy, TIS) puts exactly 0 gradient on the logits that predict them, and its token
    normalizer counts sampled tokens only."""
    from learner.batch import response_logprobs

    torch.manual_seed(0)
    masks = [[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1, 1, 1, 0]]  # turn | observation | turn
    batch = build_batch([[3, 4], [5]], [[6, 7, 8, 9, 10, 11, 12], [7, 8, 9, 10, 11, 12, 13]],
                        [[-1.0] * 7, [-1.0] * 7], 0, masks)
    assert batch.response_mask.tolist() == [[float(m) for m in row] for row in masks]
    assert batch.rollout_logprobs[0, 2:5].tolist() == [0.0, 0.0, 0.0]
    logits = torch.randn(2, batch.input_ids.shape[1], 20, requires_grad=True)
    logp, entropy = response_logprobs(logits, batch)
    scale = batch.with_scale().scale
    assert scale.num_tokens == 8
    loss, _ = policy_loss(logp, logp.detach() + 0.1, torch.randn(2, 7), batch.response_mask, scale,
                          aggregation=aggregation, ref_logp=logp.detach() - 0.2, kl_coef=0.1, entropy=entropy,
                          entropy_coef=0.01, rollout_logp=batch.rollout_logprobs, tis_cap=2.0)
    loss.backward()
    P = batch.prompt_len
    grad = logits.grad[:, P - 1: -1]  # row t predicts response token t
    for i, row in enumerate(masks):
        for t, m in enumerate(row):
            assert (grad[i, t].abs().sum() == 0) == (m == 0), (i, t)


def test_the_learner_asks_each_loss_what_it_reads():
    """The learner is algorithm-blind: entropy, the fused old logprobs and the engine gap are computed for a loss
    whose signature reads them (the policy loss), never for SFT, DPO or the PRM's."""
    from learner.losses import loss_inputs

    assert {"entropy", "old_logp", "rollout_logp"} <= loss_inputs("policy")
    for name in ("sft", "dpo", "prm", "bradley_terry"):
        assert not {"entropy", "old_logp", "rollout_logp"} & loss_inputs(name)
    assert "tis_cap" not in loss_inputs("policy")  # a setting, not an input
