"""Reward functions and the reward worker's error handling (a failing function scores 0 and is counted)."""

import time

import pytest

from rewards.functions import REWARD_FUNCTIONS, answers_equal, extract_answer, load_reward_function, math_reward
from rewards.tasks import ArithmeticTask
from rewards.worker import RewardFunctionError, RewardWorker


@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("work... #### 42", "42"),
    ("12+30=42", "42"),
    ("first 3 then -7.5", "-7.5"),
    ("no number", None),
    ("\\boxed{x^{2}} and later 5", "x^{2}"),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("a,b,eq", [("1/2", "0.5", True), ("\\frac{1}{2}", "0.5", True), ("42", "42.0", True),
                                    ("41", "42", False), ("2", "\\frac{4}{2}", True)])
def test_answers_equal(a, b, eq):
    assert answers_equal(a, b) is eq


def test_math_reward_on_arithmetic_task():
    p = ArithmeticTask().make("u", 12, 30)
    assert math_reward(p.text, "42", p.metadata) == 1.0
    assert math_reward(p.text, "43", p.metadata) == 0.0
    assert math_reward(p.text, "", p.metadata) == 0.0


def test_task_eval_split_is_held_out_and_fixed():
    t = ArithmeticTask(seed=3)
    ev = {p.text for p in t.eval_set(500)}
    train = {p.text for s in range(50) for p in t.train_batch(s, 16)}
    assert not ev & train
    assert [p.text for p in ArithmeticTask(seed=9).eval_set(20)] == [p.text for p in t.eval_set(20)]
    assert [p.text for p in t.train_batch(7, 4)] == [p.text for p in ArithmeticTask(seed=3).train_batch(7, 4)]


def _raises(prompt, completion, metadata):
    raise ValueError("boom")


def _hangs(prompt, completion, metadata):
    time.sleep(3)
    return 1.0


def _components(prompt, completion, metadata):
    return {"a": 1.0, "b": 0.5}


def test_worker_counts_errors_and_timeouts_and_keeps_going():
    specs = [("math", 1.0, {}), ("tests.test_rewards:_raises", 1.0, {}), ("tests.test_rewards:_hangs", 1.0, {})]
    w = RewardWorker(specs, timeout_s=0.5, strict=False)
    results, errors = w.score([("1+1=", "2", {"answer": "2"}), ("1+1=", "3", {"answer": "2"})])
    assert [r.reward for r in results] == [1.0, 0.0]
    assert errors == 4 and w.stats()["errors"] == 4
    assert results[0].components["tests.test_rewards:_raises"] == 0.0


def test_worker_strict_mode_is_fatal():
    w = RewardWorker([("tests.test_rewards:_raises", 1.0, {})], timeout_s=1, strict=True)
    with pytest.raises(RewardFunctionError, match="boom"):
        w.score([("p", "c", {})])


def test_dict_rewards_are_components_and_weights_apply():
    w = RewardWorker([("tests.test_rewards:_components", 2.0, {})], timeout_s=1, strict=False)
    (r,), _ = w.score([("p", "c", {})])
    assert r.components == {"tests.test_rewards:_components/a": 1.0, "tests.test_rewards:_components/b": 0.5}
    assert r.reward == pytest.approx(3.0)


def test_plugin_loading_errors_are_clear():
    assert load_reward_function("math") is REWARD_FUNCTIONS["math"]
    with pytest.raises(KeyError, match="built-ins"):
        load_reward_function("nope")
    with pytest.raises(KeyError, match="no callable"):
        load_reward_function("tests.test_rewards:missing")


def test_format_length_choice_builtins():
    f, n, c = REWARD_FUNCTIONS["format"], REWARD_FUNCTIONS["length"], REWARD_FUNCTIONS["choice"]
    assert f("q", "<think>2+2 is 4</think> 4", {}) == 1.0
    assert f("q", "4 <think>x</think>", {}) == 0.0 and f("q", "<think>x</think>", {}) == 0.0
    assert n("q", "x" * 10, {}, max_len=20, cache=5) == 0.0
    assert n("q", "x" * 18, {}, max_len=20, cache=5) == pytest.approx(-0.6)
    assert n("q", "x" * 40, {}, max_len=20, cache=5) == -1.0
    assert c("q", "I think B, no, the answer is C.", {"answer": "C"}) == 1.0
    assert c("q", "The answer is (B)", {"answer": "C"}) == 0.0


def test_params_are_bound():
    w = RewardWorker([("length", 1.0, {"max_len": 4, "cache": 2})], timeout_s=1, strict=False)
    (r,), errors = w.score([("p", "12345", {})])
    assert errors == 0 and r.reward == -1.0
