"""Reward functions and the reward worker's error handling (a failing function scores 0 and is counted)."""

import time

import math_verify
import pytest

from rewards.functions import REWARD_FUNCTIONS, is_correct, load_reward_function, math_reward
from rewards.tasks import ArithmeticTask
from rewards.worker import RewardFunctionError, RewardWorker


@pytest.mark.parametrize("completion,right,wrong", [
    ("So $\\frac{3}{4}$ of the cake is left.", ["3/4", "0.75", "\\frac{3}{4}"], ["4", "3"]),  # LaTeX, no \boxed
    ("\\boxed{12}", ["12"], ["13"]),
    ("The answer is 42.", ["42", "42.0"], ["4"]),
    ("So 1,000 + 234 = 1,234 dollars.\n#### 1,234", ["1234"], ["234"]),  # GSM8K ending, thousands separator
    ("I first wrote \\boxed{5}, a slip.\n#### 18", ["18"], ["5"]),  # the GSM8K ending beats an earlier \boxed
    ("It fell to -7 degrees overnight.", ["-7"], ["7"]),
    ("-12", ["-12"], ["12"]),
    (" 57\n", ["57", "57.0"], ["58"]),
])
def test_math_reward_reads_the_final_answer(completion, right, wrong):
    for answer in right:
        assert math_reward("q", completion, {"answer": answer}) == 1.0, answer
    for answer in wrong:
        assert math_reward("q", completion, {"answer": answer}) == 0.0, answer


@pytest.mark.parametrize("completion,answer", [("57", "57"), ("57", "58"), ("-3", "-3"), ("-3", "3"), ("007", "7"),
                                               ("-0", "0"), ("0", "10"), (str(10**20), str(10**20 + 1)),
                                               ("100", "1"), ("12", "012")])
def test_plain_integers_agree_with_math_verify(completion, answer):
    gold = math_verify.parse(f"${answer}$", parsing_timeout=None)
    pred = math_verify.parse(f"${completion}$", parsing_timeout=None)
    expected = float(math_verify.verify(gold, pred, timeout_seconds=None))
    assert math_reward("q", completion, {"answer": answer}) == expected


def test_is_correct_needs_a_full_score():
    def const(value):
        return lambda prompt, completion, metadata: value

    assert is_correct(const(1.0), "q", "c", {}) and is_correct(const(1.5), "q", "c", {})
    assert not is_correct(const(0.99), "q", "c", {}) and not is_correct(const(0.1), "q", "c", {})
    assert is_correct(const({"a": 1.0, "b": 1.0}), "q", "c", {})
    assert not is_correct(const({"a": 1.0, "b": 0.5}), "q", "c", {}) and not is_correct(const({}), "q", "c", {})
    assert is_correct(math_reward, "1+1=", "2", {"answer": "2"})
    assert not is_correct(math_reward, "1+1=", "3", {"answer": "2"})


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
    results, errors, timeouts, first = w.score([("1+1=", "2", {"answer": "2"}), ("1+1=", "3", {"answer": "2"})])
    assert [r.reward for r in results] == [1.0, 0.0]
    assert errors == 2 and w.stats()["errors"] == 2 and timeouts == 2 and w.stats()["timeouts"] == 2
    assert results[0].components["tests.test_rewards:_raises"] == 0.0
    assert first == "reward function 'tests.test_rewards:_raises' raised ValueError: boom"  # what a stopped run says


def test_worker_strict_mode_is_fatal():
    w = RewardWorker([("tests.test_rewards:_raises", 1.0, {})], timeout_s=1, strict=True)
    with pytest.raises(RewardFunctionError, match="boom"):
        w.score([("p", "c", {})])


def test_dict_rewards_are_components_and_weights_apply():
    w = RewardWorker([("tests.test_rewards:_components", 2.0, {})], timeout_s=1, strict=False)
    (r,), *_ = w.score([("p", "c", {})])
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
    (r,), errors, *_ = w.score([("p", "12345", {})])
    assert errors == 0 and r.reward == -1.0
