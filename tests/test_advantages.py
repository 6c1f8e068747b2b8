"""Advantage estimators against the seed formulas, their worked examples, and loop implementations."""

import math

import pytest
import torch

from learner.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_gae,
    compute_gdpo,
    compute_grpo,
    compute_grpo_process,
    compute_reinforce_pp,
    compute_reinforce_pp_baseline,
    compute_rloo,
    conditioned_rewards,
    get_estimator,
)

S = 1 / math.sqrt(2)  # 0.7071


def _seq(adv):  # first token of each row
    return adv[:, 0]


def test_grpo_seed_example_two_rewards_collapse():
    """Rewards (0,1) and (0,2) both give (-0.7071, 0.7071) under GRPO (unbiased std)."""
    mask = torch.ones(2, 3)
    for rewards in ([0.0, 1.0], [0.0, 2.0]):
        adv = compute_grpo(torch.tensor(rewards), torch.tensor([0, 0]), mask)
        assert torch.allclose(_seq(adv), torch.tensor([-S, S]), atol=1e-4)
        assert torch.allclose(adv, _seq(adv)[:, None].expand(2, 3))


def test_grpo_broadcasts_only_over_valid_tokens_and_singletons_get_zero():
    rewards = torch.tensor([1.0, 0.0, 5.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    adv = compute_grpo(rewards, torch.tensor([0, 0, 1]), mask)
    assert torch.all(adv[mask == 0] == 0)
    assert torch.all(adv[2] == 0)  # a group of one
    assert adv[0, 0] > 0 > adv[1, 0]


def test_dr_grpo_is_mean_subtraction_seed_example():
    """Scores [90, 70, 85, 75] with the mean subtracted give [10, -10, 5, -5]."""
    adv = compute_grpo(torch.tensor([90.0, 70, 85, 75]), torch.zeros(4, dtype=torch.long), torch.ones(4, 1),
                       scale_by_std=False)
    assert torch.allclose(adv[:, 0], torch.tensor([10.0, -10, 5, -5]))
    assert torch.equal(ADVANTAGE_ESTIMATORS["dr_grpo"](torch.tensor([90.0, 70, 85, 75]),
                                                       torch.zeros(4, dtype=torch.long), torch.ones(4, 1)), adv)


def _grpo_loop(rewards, groups, eps=1e-6):
    out = []
    for i in range(len(rewards)):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        if len(members) == 1:
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
        out.append((rewards[i] - mean) / (std + eps))
    return out


def _rloo_loop(rewards, groups):
    out = []
    for i in range(len(rewards)):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
        out.append(rewards[i] - sum(others) / len(others) if others else 0.0)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_group_estimators_match_loops_on_random_batches(seed):
    g = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, 5, (40,), generator=g)
    rewards = torch.randn(40, generator=g, dtype=torch.float64)
    mask = torch.ones(40, 2, dtype=torch.float64)
    r, gr = rewards.tolist(), groups.tolist()
    f64 = torch.float64
    assert torch.allclose(compute_grpo(rewards, groups, mask)[:, 0], torch.tensor(_grpo_loop(r, gr), dtype=f64))
    assert torch.allclose(compute_rloo(rewards, groups, mask)[:, 0], torch.tensor(_rloo_loop(r, gr), dtype=f64))


def test_rloo_leave_one_out():
    adv = compute_rloo(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long), torch.ones(4, 1))
    assert torch.allclose(adv[:, 0], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))


def _gae_loop(r, v, gamma, lam):
    T = len(r)
    adv = [0.0] * T
    last = 0.0
    for t in reversed(range(T)):
        nv = v[t + 1] if t + 1 < T else 0.0
        delta = r[t] + gamma * nv - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


def test_gae_lambda_zero_is_td_residual_and_one_is_return_minus_value():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6)
    gamma = 0.9
    adv0, _ = compute_gae(r, v, mask, gamma, 0.0)
    next_v = torch.cat([v[:, 1:], torch.zeros(3, 1)], 1)
    assert torch.allclose(adv0, r + gamma * next_v - v, atol=1e-6)
    adv1, ret1 = compute_gae(r, v, mask, gamma, 1.0)
    disc = torch.zeros_like(r)
    run = torch.zeros(3)
    for t in reversed(range(6)):
        run = r[:, t] + gamma * run
        disc[:, t] = run
    assert torch.allclose(adv1, disc - v, atol=1e-5)
    assert torch.allclose(ret1, adv1 + v, atol=1e-6)


def test_gae_matches_loop_and_treats_padding_as_terminal():
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(4, 7, generator=g, dtype=torch.float64), torch.randn(4, 7, generator=g, dtype=torch.float64)
    lengths = [7, 3, 1, 5]
    mask = torch.tensor([[1.0] * n + [0.0] * (7 - n) for n in lengths], dtype=torch.float64)
    adv, _ = compute_gae(r, v, mask, 0.95, 0.8)
    for i, n in enumerate(lengths):
        loop = _gae_loop(r[i, :n].tolist(), v[i, :n].tolist(), 0.95, 0.8)
        assert torch.allclose(adv[i, :n], torch.tensor(loop, dtype=torch.float64))
        assert torch.all(adv[i, n:] == 0)
    wadv, _ = compute_gae(r, v, mask, 0.95, 0.8, whiten=True)
    valid = wadv[mask.bool()]
    assert abs(valid.mean().item()) < 1e-6 and abs(valid.std(unbiased=False).item() - 1) < 1e-4


def test_token_level_estimators_skip_masked_positions_inside_a_sequence():
    """A multi-turn episode: observation tokens (mask 0) sit between turns. GAE and the return-to-go must skip them
    (the next step of a turn's last token is the next turn's first token), i.e. equal the sequence with them removed,
    and be 0 on them."""
    g = torch.Generator().manual_seed(2)
    r, v = torch.randn(3, 9, generator=g, dtype=torch.float64), torch.randn(3, 9, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0], [1, 0, 1, 0, 1, 0, 1, 0, 0], [1] * 9], dtype=torch.float64)
    adv, ret = compute_gae(r, v, mask, 0.9, 0.7)
    _, returns = compute_reinforce_pp(r, mask, gamma=0.8)
    for i in range(3):
        keep = mask[i].bool()
        loop = _gae_loop(r[i, keep].tolist(), v[i, keep].tolist(), 0.9, 0.7)
        assert torch.allclose(adv[i, keep], torch.tensor(loop, dtype=torch.float64))
        assert torch.allclose(ret[i, keep], adv[i, keep] + v[i, keep])
        running, expected = 0.0, []
        for x in reversed(r[i, keep].tolist()):
            running = x + 0.8 * running
            expected.append(running)
        assert torch.allclose(returns[i, keep], torch.tensor(expected[::-1], dtype=torch.float64))
        assert torch.all(adv[i, ~keep] == 0) and torch.all(returns[i, ~keep] == 0)


def test_reinforce_pp_whitened_return_to_go():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    adv, ret = compute_reinforce_pp(r, mask, gamma=0.5)
    assert torch.allclose(ret, torch.tensor([[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]]))
    valid = adv[mask.bool()]
    assert abs(valid.mean()) < 1e-6 and abs(valid.std(unbiased=False) - 1) < 1e-4
    base = compute_reinforce_pp_baseline(torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1]),
                                         torch.ones(4, 2))
    assert torch.allclose(base[2], torch.zeros(2), atol=1e-6) and base[0, 0] > 0 > base[1, 0]


def test_gdpo_seed_example_keeps_reward_differences():
    """With two rewards, (0,1) and (0,2) both give (-0.7071, 0.7071) per component under GRPO, while
    GDPO's per-component normalization of two components (0,1) and (0,1) gives (-1.4142, 1.4142) before the
    batch normalization, vs (-0.7071, 0.7071) for one component; after it, rank order is preserved."""
    groups = torch.tensor([0, 0])
    one = torch.tensor([[0.0, 0.0], [1.0, 0.0]])  # only the first reward differs
    two = torch.tensor([[0.0, 0.0], [1.0, 1.0]])  # both rewards differ
    per_k = lambda comps: sum(compute_grpo(comps[:, k], groups, torch.ones(2, 1))[:, 0] for k in range(2))  # noqa
    assert torch.allclose(per_k(one), torch.tensor([-S, S]), atol=1e-4)
    assert torch.allclose(per_k(two), torch.tensor([-2 * S, 2 * S]), atol=1e-4)
    # the summed-reward GRPO collapses both cases to the same advantages (the seed's point)
    assert torch.allclose(compute_grpo(one.sum(1), groups, torch.ones(2, 1)),
                          compute_grpo(two.sum(1), groups, torch.ones(2, 1)), atol=1e-5)
    # GDPO over a batch with both groups keeps them apart
    comps = torch.cat([one, two])
    adv = compute_gdpo(comps, torch.tensor([0, 0, 1, 1]), torch.ones(4, 1))[:, 0]
    assert adv[3] > adv[1] > adv[0] > adv[2]
    assert torch.isclose(adv[0] + adv[1], torch.tensor(0.0), atol=1e-6)
    assert abs(adv.mean()) < 1e-6 and abs(adv.std() - 1) < 1e-4


def test_gdpo_weights():
    comps = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    adv = compute_gdpo(comps, torch.tensor([0, 0]), torch.ones(2, 1), weights=torch.tensor([2.0, 1.0]))
    assert adv[1, 0] > 0 > adv[0, 0]


def test_conditioned_rewards():
    comps = torch.tensor([[1.0, 0.2], [1.0, 0.9], [0.0, 1.0]])
    out = conditioned_rewards(comps, [(0, 1, 0.5)])  # correctness counts only with format >= 0.5
    assert torch.equal(out[:, 0], torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(out[:, 1], comps[:, 1])


def test_grpo_process_sums_normalized_future_step_rewards():
    step_rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    step_ends = torch.tensor([[1, 3], [3, -1]])
    adv = compute_grpo_process(step_rewards, step_ends, torch.tensor([0, 0]), torch.ones(2, 4))
    vals = torch.tensor([1.0, 0.0, 0.0])
    n = (vals - vals.mean()) / (vals.std() + 1e-6)  # steps of the group, normalized together
    assert torch.allclose(adv[0], torch.tensor([n[0] + n[1], n[0] + n[1], n[1], n[1]]), atol=1e-5)
    assert torch.allclose(adv[1], n[2].expand(4), atol=1e-5)


def test_registry_rejects_unknown_names_listing_valid_ones():
    with pytest.raises(KeyError, match="grpo"):
        get_estimator("nope")
    for name in ("grpo", "dr_grpo", "rloo", "gae", "reinforce_pp", "reinforce_pp_baseline", "gdpo", "grpo_process"):
        assert name in ADVANTAGE_ESTIMATORS


def test_step_boundaries_for_process_supervision():
    from orchestrator.rl.reasoning_steps import step_ends as _step_ends

    assert _step_ends(["4", "2", "<eos>"], "") == [0, 1, 2]
    assert _step_ends(["a", "\n", "b", "c"], "\n") == [1, 3]
    assert _step_ends(["a", "b\n"], "\n") == [1]
    assert _step_ends([], "\n") == []
