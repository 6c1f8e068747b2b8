"""bench/async_sim.py, the discrete-event model of the rollout modes: its cost model against a hand computation,
async with eta = 0 is sync, the staleness bound holds, and every completion is trained once or counted dropped."""

import random

import pytest

from bench.async_sim import Costs, Workload, long_tail, simulate

COSTS = Costs(engines=2, max_seqs=16, step_s=0.02, per_seq_s=0.001, train_s=0.5, per_token_s=0.001, push_s=0.2)
SKEWED = Workload(prompts_per_step=4, group_size=4, lengths=long_tail(10, 80, 0.1), steps=12)


def test_sync_with_fixed_lengths_takes_the_hand_computed_time():
    """4 prompts x G=4 of exactly 10 tokens on 2 engines (8 sequences each): a step generates in 10 decode steps of
    0.02 + 8 * 0.001 s, trains 160 tokens in 0.5 + 0.16 s, pushes in 0.2 s."""
    work = Workload(prompts_per_step=4, group_size=4, lengths=lambda rng: 10, steps=3)
    r = simulate("sync", COSTS, work)
    step = 10 * (0.02 + 8 * 0.001) + (0.5 + 160 * 0.001) + 0.2
    assert r.wall_s == pytest.approx(3 * step)
    assert r.completions == 48 and r.staleness == [0] * 480


def test_async_with_eta_zero_is_sync():
    sync, async0 = simulate("sync", COSTS, SKEWED), simulate("async", COSTS, SKEWED, eta=0)
    assert async0.wall_s == pytest.approx(sync.wall_s) and async0.staleness == sync.staleness
    assert async0.partial == async0.dropped == 0


@pytest.mark.parametrize("eta", [1, 2, 4])
def test_no_trained_token_is_older_than_eta_and_every_completion_is_accounted(eta):
    r = simulate("async", COSTS, SKEWED, eta=eta)
    assert max(r.staleness) <= eta and r.completions == SKEWED.steps * 4 * 4
    assert r.partial > 0  # pushes met samples mid-generation on this long-tailed workload
    one_step_off = simulate("one_step_off", COSTS, SKEWED)
    assert max(one_step_off.staleness) == 1


def test_overlap_beats_taking_turns_on_long_tails():
    """The model's point: with skewed lengths the engines idle behind the longest sample in sync; overlap and
    async fill that time (the learner has its own hardware here)."""
    sync = simulate("sync", COSTS, SKEWED).completions_per_s
    assert simulate("one_step_off", COSTS, SKEWED).completions_per_s > sync
    assert simulate("async", COSTS, SKEWED, eta=4).completions_per_s > 1.3 * sync
    assert long_tail(10, 80, 0.1)(random.Random(0)) >= 1
