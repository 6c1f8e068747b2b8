"""The driver-side advantage assembly of every algorithm (learner/algorithms.py), on small batches worked out by
hand: prompt uid -> group id, reward components by name, PPO's outcome reward on the last response token and its
KL-shaped per-token reward, GDPO's name mapping and conditions, process rewards aligned to the tokens that end each
step. Pure torch, no Ray."""

from dataclasses import replace

import pytest
import torch

from learner.advantages import get_estimator
from learner.algorithms import ALGORITHMS, advantage_inputs, assemble_advantages, loss_kwargs, preference_pairs
from learner.losses import LOSSES
from orchestrator.config import algorithm_sections as algorithm_configs
from orchestrator.config import load_config
from orchestrator.rl.reasoning_steps import step_ends as _step_ends

# 4 samples, 2 prompts interleaved (a resize or a restart can reorder nothing, but uids are what counts)
UIDS = ["p7", "p3", "p7", "p3"]
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)


def algo(name: str, *overrides: str):
    return load_config(None, [f"algorithm.name={name}", *overrides]).algorithm


def test_every_algorithm_config_has_exactly_one_assembly_function():
    """Policy-gradient algorithms: one advantage assembly each. The others (SFT, DPO) name a registered loss."""
    sections = algorithm_configs.ALGORITHM_SECTIONS
    policy = {cls.model_fields["name"].default for cls in sections if cls.objective == "policy"}
    assert policy == set(ALGORITHMS)
    others = {cls.objective for cls in algorithm_configs.ALGORITHM_SECTIONS if cls.objective != "policy"}
    assert others == {"sft", "dpo", "prm", "bradley_terry"} and others <= set(LOSSES)


def test_prompt_uids_become_group_ids_and_components_are_sorted_by_name():
    x = advantage_inputs([1.0, 0.0, 0.5, 0.25], [{"math": 1.0, "format": 1.0}, {"math": 0.0}, {"format": 0.5},
                                                 {"length": -0.5}], UIDS, MASK)
    assert x.group_ids.tolist() == [0, 1, 0, 1]
    assert x.component_names == ["format", "length", "math"]
    assert x.components.tolist() == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, -0.5, 0.0]]


def test_grpo_groups_by_prompt_uid_not_by_position():
    x = advantage_inputs([1.0, 0.0, 0.0, 0.0], [{}] * 4, UIDS, MASK)
    adv, returns = assemble_advantages(algo("grpo"), x)
    # group p7 = samples 0, 2 (rewards 1, 0): +-0.5 / std 0.7071; group p3 = samples 1, 3 (both 0): no signal
    expected = torch.tensor([1.0, 0.0, -1.0, 0.0]) * 0.5 / (0.5 ** 0.5 + 1e-6)
    assert returns is None
    assert torch.allclose(adv, expected[:, None] * MASK, atol=1e-6)


def test_ppo_puts_the_outcome_reward_on_the_last_response_token():
    x = advantage_inputs([2.0, 0.0, 1.0, -1.0], [{}] * 4, UIDS, MASK, values=torch.zeros(4, 4))
    adv, returns = assemble_advantages(algo("ppo", "algorithm.gamma=1.0", "algorithm.lam=1.0",
                                            "algorithm.whiten_advantages=false"), x)
    # gamma = lam = 1, V = 0: every valid token's return is the sequence's outcome reward; padding gets 0
    assert torch.equal(returns, torch.tensor([2.0, 0.0, 1.0, -1.0])[:, None] * MASK)
    assert torch.equal(adv, returns)
    # with gamma < 1 the reward sits on the last token: earlier tokens see it discounted once per step
    adv, _ = assemble_advantages(algo("ppo", "algorithm.gamma=0.5", "algorithm.lam=1.0",
                                      "algorithm.whiten_advantages=false"), x)
    assert adv[0].tolist() == [0.5, 1.0, 2.0, 0.0] and adv[2].tolist() == [0.125, 0.25, 0.5, 1.0]


def test_ppo_kl_shaped_reward_is_charged_on_every_response_token():
    old = torch.tensor([[-1.0, -2.0, -0.5, 9.0]]).repeat(4, 1)
    ref = torch.tensor([[-1.5, -1.0, -0.5, -9.0]]).repeat(4, 1)
    x = advantage_inputs([1.0, 1.0, 1.0, 1.0], [{}] * 4, UIDS, MASK, values=torch.zeros(4, 4), old_logprobs=old,
                         ref_logprobs=ref)
    cfg = algo("ppo", "algorithm.gamma=1.0", "algorithm.lam=1.0", "algorithm.whiten_advantages=false",
               "algorithm.kl_reward_coef=0.1")
    _, returns = assemble_advantages(cfg, x)
    # k1 = old - ref per token: 0.5, -1.0, 0.0 on sample 0's three tokens; reward = -0.1 * k1, +1 on the last
    token_rewards = torch.tensor([-0.05, 0.1, 1.0])
    assert torch.allclose(returns[0, :3], token_rewards.flip(0).cumsum(0).flip(0), atol=1e-6)
    assert returns[0, 3] == 0  # padding: no KL charge even where the logprobs differ wildly


def test_gdpo_maps_weights_and_conditions_by_component_name():
    comps = [{"math": 1.0, "format": 1.0}, {"math": 1.0, "format": 0.0}, {"math": 0.0, "format": 1.0},
             {"math": 1.0, "format": 1.0}]
    x = advantage_inputs([0.0] * 4, comps, UIDS, MASK)
    cfg = algo("gdpo", "algorithm.weights={math: 2.0, format: 0.5}",
               "algorithm.conditions=[{reward: format, if_reward: math, threshold: 1.0}]")
    adv, _ = assemble_advantages(cfg, x)
    # columns are (format, math); format only counts where math >= 1, so sample 2 loses its format reward
    conditioned = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    expected = get_estimator("gdpo")(conditioned, x.group_ids, MASK, weights=torch.tensor([0.5, 2.0]), eps=1e-6)
    assert torch.allclose(adv, expected, atol=1e-6)
    swapped = get_estimator("gdpo")(conditioned, x.group_ids, MASK, weights=torch.tensor([2.0, 0.5]), eps=1e-6)
    assert not torch.allclose(adv, swapped)  # the weights really follow the names, not positions
    unconditioned = get_estimator("gdpo")(x.components, x.group_ids, MASK, weights=torch.tensor([0.5, 2.0]))
    assert not torch.allclose(adv, unconditioned)  # and the condition changed the result
    with pytest.raises(KeyError, match="unknown reward component 'correct'.*'format', 'math'"):
        assemble_advantages(algo("gdpo", "algorithm.weights={correct: 1.0}"), x)


def test_process_rewards_land_on_the_tokens_that_end_each_step():
    texts = ["Add", " 2\n", "then", " 3\n", "= 5"]
    ends = _step_ends(texts, "\n")
    assert ends == [1, 3, 4]  # the two newline tokens, and the last token
    assert _step_ends(["a", "b\n"], "\n") == [1] and _step_ends(["a", "b"], "") == [0, 1]
    mask = torch.ones(2, 5)
    step_rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    step_ends = torch.tensor([ends, [4, -1, -1]])
    x = advantage_inputs([0.0, 0.0], [{}, {}], ["p", "p"], mask, steps=(step_rewards, step_ends))
    adv, _ = assemble_advantages(algo("grpo_process"), x)
    # the group's 4 present step rewards {1, 0, 1, 0}: mean 0.5, std 0.577
    n = (torch.tensor([1.0, 0.0, 1.0, 0.0]) - 0.5) / (torch.tensor([1.0, 0.0, 1.0, 0.0]).std() + 1e-6)
    # token t sums the normalized rewards of the steps ending at or after t
    assert torch.allclose(adv[0], torch.stack([n[0] + n[1] + n[2]] * 2 + [n[1] + n[2]] * 2 + [n[2]]), atol=1e-5)
    assert torch.allclose(adv[1], n[3].repeat(5), atol=1e-5)


def test_loss_settings_come_from_the_config_section():
    kw = loss_kwargs(algo("grpo", "algorithm.clip_high=0.28", "algorithm.kl_coef=0.05"))
    assert kw["clip_high"] == 0.28 and kw["kl_coef"] == 0.05 and set(kw) >= {"aggregation", "tis_cap"}
    assert kw["objective"] == "policy"
    assert loss_kwargs(algo("dpo", "algorithm.beta=0.3")) == {"objective": "dpo", "beta": 0.3, "label_smoothing": 0.0}
    assert loss_kwargs(algo("sft")) == {"objective": "sft"}


def test_online_dpo_pairs_each_groups_best_and_worst_when_the_gap_is_large_enough():
    rewards = [0.0, 1.0, 0.2, 0.5, 0.5, 0.5, 1.0, 0.0, 1.0]
    uids = ["a", "a", "a", "b", "b", "b", "c", "c", "c"]
    assert preference_pairs(rewards, uids, 0.5) == [(1, 0), (6, 7)]  # group b: no gap; c: first best kept
    assert preference_pairs(rewards, uids, 1.5) == []


# ---- multi-turn episodes: interleaved masks, per-turn rewards ---------------------------------------------------
# one episode: turn 1 = tokens 0-1, observation = tokens 2-3 (mask 0), turn 2 = tokens 4-5, padding = 6
EPISODE_MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.float32)


def test_episode_outcome_on_the_last_sampled_token_and_turn_rewards_on_their_turns():
    x = advantage_inputs([1.0], [{}], ["p"], EPISODE_MASK, values=torch.zeros(1, 7), turns=[([1, 5], [0.25, 0.0])])
    assert x.rewards.tolist() == [1.25]  # the episode's return: outcome + turn rewards (for group estimators)
    assert x.outcome_token_rewards().tolist() == [[0.0, 0.25, 0.0, 0.0, 0.0, 1.0, 0.0]]
    adv, returns = assemble_advantages(algo("ppo", "algorithm.gamma=0.5", "algorithm.lam=1.0",
                                            "algorithm.whiten_advantages=false"), x)
    # gamma 0.5 over the sampled tokens only (the observation tokens are not steps): rewards [0, .25, 1 | 0]
    # at tokens 0, 1, 4, 5 -> returns 1.0 at 5, 0.5 at 4, 0.25 + 0.25 at 1, 0.25 at 0
    assert returns.tolist() == [[0.25, 0.5, 0.0, 0.0, 0.5, 1.0, 0.0]] and torch.equal(adv, returns)


def test_group_advantages_over_episodes_by_hand():
    """GRPO over the G episodes of one task, broadcast to each episode's sampled tokens only."""
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    x = advantage_inputs([1.0, 0.0, 0.0], [{}] * 3, ["t", "t", "t"], mask, turns=[([0, 2], [0.5, 0.0]), ([1], [0.0]),
                                                                                 ([0], [0.0])])
    adv, _ = assemble_advantages(algo("grpo"), x)
    returns = torch.tensor([1.5, 0.0, 0.0])  # episode returns
    by_hand = (returns - returns.mean()) / (returns.std() + 1e-6)
    assert torch.allclose(adv, by_hand[:, None] * mask, atol=1e-6)


def test_on_policy_distill_advantage_is_the_teachers_logprob_minus_the_students_on_each_token():
    """Each token's advantage is log pi_teacher - log pi_student of that token (no baseline, no discount);
    the task reward enters only with ``reward_weight``, as GRPO's advantage scaled by it."""
    student = torch.tensor([[-0.5, -1.0, -2.0, 0.0], [-0.1, -0.2, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0],
                            [-3.0, 0.0, 0.0, 0.0]]) * MASK
    teacher = torch.tensor([[-0.25, -3.0, -2.0, 0.0], [-0.1, -0.7, 0.0, 0.0], [-0.5, -2.0, -1.0, -0.125],
                            [-1.0, 0.0, 0.0, 0.0]]) * MASK
    x = replace(advantage_inputs([1.0, 0.0, 0.0, 1.0], [{}] * 4, UIDS, MASK), rollout_logprobs=student,
                teacher_logprobs=teacher)
    adv, returns = assemble_advantages(algo("on_policy_distill"), x)
    assert returns is None
    assert adv[0].tolist() == [0.25, -2.0, 0.0, 0.0] and adv[3].tolist() == [2.0, 0.0, 0.0, 0.0]
    assert torch.equal(adv, (teacher - student) * MASK)
    same = replace(x, teacher_logprobs=student.clone())
    assert torch.equal(assemble_advantages(algo("on_policy_distill"), same)[0], torch.zeros(4, 4))
    mixed, _ = assemble_advantages(algo("on_policy_distill", "algorithm.reward_weight=0.5"), x)
    grpo, _ = assemble_advantages(algo("grpo"), x)
    assert torch.allclose(mixed, adv + 0.5 * grpo)
