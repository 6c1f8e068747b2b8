"""Finite rewards or no reward: a NaN or an infinity from a reward function or an environment is an
error at its entry (counted, scored 0 or the episode errored), and a sample that still reaches the step without a
finite reward is masked out of the update, so one careless value never makes the step's loss NaN. The agent
endpoint's side (a 400 naming the field) is tests/test_agent_endpoint.py's table."""

import copy
import math

import pytest
import torch

from learner.algorithms import advantage_inputs, assemble_advantages
from learner.losses import LossScale, policy_loss
from orchestrator.config import load_config
from orchestrator.rl.collect import mask_invalid_rewards, samples_to_batch
from rewards.worker import RewardWorker
from tests.test_envs import TOK, play, scripted
from workers.envs.api import Environment, StepResult
from workers.envs.renderers import TextRenderer
from workers.records import EpisodeStats, Sample, ScoredSample


def careless(prompt, completion, metadata):
    """A reward function that returns NaN, an infinity, an integer beyond float range or a NaN component."""
    return {"nan": math.nan, "inf": -math.inf, "big": 10 ** 400, "dict": {"a": math.nan, "b": 1.0}}.get(completion,
                                                                                                        1.0)


def careless_sometimes(prompt, completion, metadata):
    """1.0, or NaN for about one sample in eight (by a hash of the text, so a run is repeatable)."""
    import zlib

    return math.nan if zlib.crc32(f"{prompt}|{completion}".encode()) % 8 == 0 else 1.0


def test_a_reward_function_returning_a_non_finite_value_is_an_error_scored_0():
    w = RewardWorker([("math", 1.0, {}), ("tests.test_finite_rewards:careless", 1.0, {})], timeout_s=60, strict=False)
    results, errors, timeouts, first = w.score([("1+1=", c, {"answer": "2"}) for c in ("2", "nan", "inf", "big",
                                                                                         "dict")])
    assert [r.reward for r in results] == [2.0, 0.0, 0.0, 0.0, 0.0]  # math's 1 + careless's 1; the rest errors
    assert (errors, timeouts, w.stats()["errors"]) == (4, 0, 4)  # reward/errors, under reward.max_error_frac
    assert first == "reward function 'tests.test_finite_rewards:careless' returned nan, not a finite number"
    assert all(math.isfinite(v) for r in results for v in r.components.values())


class NaNTurnReward(Environment):
    def reset(self, task, seed):
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, action):
        return StepResult([], reward=math.nan, done=True)


def test_an_environment_turn_reward_that_is_not_finite_ends_the_episode_as_env_error():
    ep = play(NaNTurnReward(), TextRenderer(TOK), scripted(TOK, ["20126"]))
    assert ep.termination == "env_error" and ep.errored and "must be finite" in ep.info["error"]
    assert ep.turn_rewards == []  # nothing non-finite is kept (the errored group is dropped: env.errored)


def _scored(uid: str, j: int, reward: float, turn: float | None = None) -> ScoredSample:
    episode = None if turn is None else EpisodeStats("done", 1, 0, 0, [], 0, 0, [3], [turn], False)
    return ScoredSample(Sample(uid, j, "p", [1, 2], [5, 6, 7, 8], [-1.0] * 4, "x", "stop", 0, episode=episode),
                        reward, {"r": reward})


def _loss(scored: list[ScoredSample]) -> tuple[torch.Tensor, torch.Tensor]:
    """The GRPO loss of the batch as the step computes it (advantages from the rewards, then the policy loss)."""
    batch = samples_to_batch([x.sample for x in scored], 0)
    turns = [(x.sample.episode.turn_ends, x.sample.episode.turn_rewards) for x in scored]
    adv, _ = assemble_advantages(load_config(None, []).algorithm, advantage_inputs(
        [x.reward for x in scored], [x.components for x in scored], [x.sample.prompt_uid for x in scored],
        batch.response_mask, turns=turns))
    logp = batch.rollout_logprobs.clone().requires_grad_()
    mask = batch.response_mask
    loss, _ = policy_loss(logp, batch.rollout_logprobs, adv, mask, LossScale(len(scored), int(mask.sum()), 4))
    return loss, adv


def test_a_sample_without_a_finite_reward_is_masked_out_and_the_loss_stays_finite():
    """Two of twelve samples carry a NaN reward or an infinite turn reward: unguarded they make the whole step's
    loss NaN (its update skipped); guarded they are masked, counted, and move no baseline."""
    scored = [_scored("a", j, r, 0.0) for j, r in enumerate([1.0, 0.0, math.nan, 1.0])] + \
        [_scored("b", j, 0.0, t) for j, t in enumerate([0.5, 0.0, math.inf, 0.0])] + \
        [_scored("c", j, r, 0.0) for j, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    unguarded, _ = _loss(copy.deepcopy(scored))
    assert math.isnan(unguarded.item())  # what one NaN did to the step before
    assert mask_invalid_rewards(scored) == 2
    loss, adv = _loss(scored)
    assert math.isfinite(loss.item()) and torch.isfinite(adv).all()
    loss.backward()  # the gradient is finite too: the update is not skipped
    for bad in (scored[2], scored[6]):
        assert bad.sample.loss_mask == [0, 0, 0, 0] and math.isfinite(bad.reward)
    assert scored[2].reward == 2 / 3 and scored[6].reward == 0.5 / 3  # the group's mean valid return
    assert adv[0, 0] > 0 > adv[1, 0] and adv[2].abs().sum() == 0 and adv[6].abs().sum() == 0
    assert torch.equal(adv[8:], _loss(scored[8:])[1])  # a group without a bad sample is untouched


@pytest.mark.e2e
def test_a_run_whose_reward_returns_nan_for_some_samples_trains_every_step():
    """Only this test guards finite rewards end to end: with a reward function that returns NaN for about one sample
    in eight, every step of `fleetrl train` on the shared fleet updates with a finite loss, and the NaNs are counted
    as reward errors (not a NaN step mean, not a skipped update)."""
    import math
    import tempfile
    from pathlib import Path

    from tests.test_e2e import run_fleetrl

    run_dir = Path(tempfile.mkdtemp(prefix="fleetrl-nan-")) / "run"
    careless = "{name: 'tests.test_finite_rewards:careless_sometimes'}"
    rows = run_fleetrl(run_dir, f"reward.functions=[{{name: math}}, {careless}]", "trainer.total_steps=3",
                       "trainer.eval_every=0", "rollout.num_workers=1", "learner.num_ranks=1", "learner.zero_stage=0")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1, 2], rows
    for r in steps:
        assert math.isfinite(r["loss"]) and math.isfinite(r["reward/mean"]), r
        assert r.get("learner/skipped_step_frac", 0.0) == 0.0, r
    assert sum(r["reward/errors"] for r in steps) > 0, steps  # the NaNs were counted
