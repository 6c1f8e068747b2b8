"""Generated tasks (countdown, multi): solvable problems, deterministic streams, disjoint eval splits, the
countdown verifier, and the multi-reward components GDPO consumes."""

import pytest

from orchestrator.config import ConfigError, DataConfig, load_config
from orchestrator.models.embedded_model import CHARS
from rewards.functions import format_reward, is_correct, length_reward, load_reward_function, math_reward
from rewards.tasks import (
    TASKS,
    ArithmeticTask,
    CountdownTask,
    MultiTask,
    countdown_expression,
    countdown_reward,
    evaluate_expression,
    make_task,
    make_task_from_config,
)
from rewards.worker import RewardWorker

META = {"answer": "24", "numbers": [4, 6, 1, 5], "target": 24}


def _all_train(task, steps=40, n=16):
    return [p for s in range(steps) for p in task.train_batch(s, n)]


@pytest.mark.parametrize("style", ["text", "compact"])
def test_countdown_problems_are_solvable_and_in_range(style):
    task = CountdownTask(max_operand=50, min_numbers=3, max_numbers=4, max_target=100, prompt_style=style)
    prompts = _all_train(task, steps=20) + task.eval_set(100)
    for p in prompts:
        m = p.metadata
        assert 3 <= len(m["numbers"]) <= 4 and all(1 <= n <= 50 for n in m["numbers"])
        assert 1 <= m["target"] <= 100 and m["answer"] == str(m["target"])
        assert countdown_reward(p.text, m["solution"], m) == 1.0, (p.text, m)  # the generator's own solution
    assert {len(p.metadata["numbers"]) for p in prompts} == {3, 4}
    if style == "compact":  # the embedded character model can read the prompt and write the solution
        assert all(set(p.text) <= set(CHARS) and set(p.metadata["solution"]) <= set(CHARS) for p in prompts)
    else:
        assert "<answer>" in prompts[0].text and str(prompts[0].metadata["numbers"]) in prompts[0].text


@pytest.mark.parametrize("cls", [CountdownTask, MultiTask])
def test_stream_is_deterministic_and_eval_split_is_disjoint(cls):
    a, b = cls(seed=1), cls(seed=1)
    assert [p.text for p in a.train_batch(7, 8)] == [p.text for p in b.train_batch(7, 8)]
    assert [p.text for p in a.train_batch(7, 8, round_=1)] != [p.text for p in a.train_batch(7, 8)]
    assert [p.text for p in cls(seed=2).train_batch(7, 8)] != [p.text for p in a.train_batch(7, 8)]
    assert [p.uid for p in a.train_batch(3, 2, round_=2)] == ["s3r2-0", "s3r2-1"]

    def key(p):
        return tuple(sorted(p.metadata["numbers"])) if cls is CountdownTask else p.text

    ev = a.eval_set(200)
    assert len(ev) == 200 and len({key(p) for p in ev}) == 200  # distinct problems
    assert [p.text for p in ev] == [p.text for p in cls(seed=99).eval_set(200)]  # independent of the run seed
    assert not {key(p) for p in ev} & {key(p) for p in _all_train(a)}


@pytest.mark.parametrize("completion,score", [
    ("<think>4 - 1 = 3... 5 / 4 - 1 = 1/4</think><answer>6 / (5 / 4 - 1)</answer>", 1.0),  # exact fractions
    ("6/(5/4-1)", 1.0),  # the embedded model's compact style: the bare expression
    ("So the equation is 6 / (5 / 4 - 1) = 24", 1.0),  # a trailing "= target" is dropped
    ("Answer: 6 / (5 / 4 - 1).", 1.0),
    ("<answer>6 / (5 / 4 - 1)</answer> and then I rambled 1+1", 1.0),  # the answer tag wins
    ("<answer>1+1</answer> <answer>6/(5/4-1)</answer>", 0.0),  # tags that disagree: no one answer
    ("<answer>(6 / (5 / 4 - 1)) * 1 / 1</answer>", 0.0),  # 1 used three times
    ("<answer>4 * 6</answer>", 0.0),  # 1 and 5 unused
    ("<answer>4 * 6 * (5 - 1 - 3)</answer>", 0.0),  # 3 is not given
    ("<answer>4 * 6 * 5 - 1</answer>", 0.0),  # right numbers, wrong value (119)
    ("<answer>4 * 6 * 1 ** 5</answer>", 0.0),  # ** is not allowed
    ("<answer>4 * 6 * 1 * 5 // 5</answer>", 0.0),  # // is not allowed (and 5 twice)
    ("<answer>-(4 - 6) * (5 + 1) * 2</answer>", 0.0),  # unary minus is not allowed
    ("<answer>4 * 6 * 1 / (5 - 5)</answer>", 0.0),  # division by zero scores 0, raises nothing
    ("<answer>__import__('os').getpid()</answer>", 0.0),  # no code runs
    ("<answer>" + "(" * 150 + "4" + ")" * 150 + "</answer>", 0.0),  # too long / too deep
    ("I give up", 0.0),
    ("", 0.0),
])
def test_countdown_reward(completion, score):
    assert countdown_reward("", completion, META) == score


def test_countdown_reward_options():
    assert countdown_reward("", "<answer>4 * 6</answer>", META, use_all=False) == 1.0  # at most once
    assert countdown_reward("", "<answer>4 * 6 * 1 * 1</answer>", META, use_all=False) == 0.0  # 1 twice
    assert countdown_reward("", "<answer>4 * 6 * 5 - 1</answer>", META, format_score=0.1) == 0.1  # TinyZero
    assert countdown_reward("", "no expression", META, format_score=0.1) == 0.0
    assert countdown_reward("", "6*(2/3)", {"answer": "4", "numbers": [2, 3, 6]}) == 1.0  # target from answer
    assert load_reward_function("countdown") is countdown_reward


def test_countdown_accuracy_needs_an_expression_not_the_target():
    """Stating the target is not a solution: the countdown task's verifier refuses it, where the math verifier
    (which every accuracy metric used before tasks named their verifier) counts it correct."""
    task = CountdownTask()
    meta = {"answer": "24", "numbers": [3, 4, 2], "target": 24}
    bare, solved = "The answer is 24.", "<think>3*4 is 12, then 12*2</think> <answer>3 * 4 * 2</answer>"
    assert task.verifier_fn is countdown_reward
    assert not is_correct(task.verifier_fn, "q", bare, meta)
    assert is_correct(task.verifier_fn, "q", solved, meta)
    assert is_correct(load_reward_function("math"), "q", bare, meta)


def test_every_task_names_its_verifier():
    assert {name: cls.verifier for name, cls in TASKS.items()} == {"arithmetic": "math", "countdown": "countdown",
                                                                  "multi": "math", "multiply": "math",
                                                                  "chain": "chain", "tool_choice": "math"}
    assert make_task_from_config(DataConfig(task="arithmetic")).verifier_fn is math_reward
    assert make_task_from_config(DataConfig(task="multi", prompt_style="compact")).verifier_fn is math_reward
    assert make_task_from_config(DataConfig(task="countdown")).verifier_fn is countdown_reward


def test_expression_helpers():
    assert countdown_expression("<think>a</think> (1 + 2) * 3 = 9") == "(1 + 2) * 3"
    assert countdown_expression("no digits here") is None
    assert evaluate_expression("(1 + 2) * 3 / 4") == (pytest.approx(9 / 4), [1, 2, 3, 4])
    assert evaluate_expression("2 ** 3") is None and evaluate_expression("1 2") is None


@pytest.mark.parametrize("style", ["text", "compact"])
def test_multi_task_answers_and_reward_components(style):
    task = MultiTask(max_operand=30, prompt_style=style)
    prompts = task.train_batch(0, 50) + task.eval_set(50)
    for p in prompts:
        expr = p.text[:-1] if style == "compact" else p.text.split()[1].rstrip(".")
        assert p.metadata["answer"] == str(eval(expr, {"__builtins__": {}}))  # noqa: S307 - test oracle on a+b*c
    if style == "compact":
        assert all(set(p.text) <= set(CHARS) for p in prompts)
    p = prompts[0]
    good = f"<think>work it out</think> {p.metadata['answer']}"
    assert math_reward(p.text, good, p.metadata) == 1.0 and format_reward(p.text, good, p.metadata) == 1.0
    assert math_reward(p.text, p.metadata["answer"], p.metadata) == 1.0
    assert format_reward(p.text, p.metadata["answer"], p.metadata) == 0.0
    assert length_reward(p.text, good * 40, p.metadata, max_len=64, cache=16) == -1.0


def test_multi_components_through_the_reward_worker():
    """The three functions GDPO normalizes separately come back as three named components."""
    p = MultiTask().eval_set(1)[0]
    worker = RewardWorker([("math", 1.0, {}), ("format", 0.5, {}), ("length", 1.0, {"max_len": 48, "cache": 16})],
                          timeout_s=5.0, strict=True)
    answer = p.metadata["answer"]
    (good, bare, long_), errors, *_ = worker.score([(p.text, f"<think>ok</think> {answer}", p.metadata),
                                                (p.text, answer, p.metadata),
                                                (p.text, f"<think>{'x' * 40}</think> {answer}", p.metadata)])
    assert errors == 0
    assert good.components == {"math": 1.0, "format": 1.0, "length": 0.0} and good.reward == 1.5
    assert bare.components == {"math": 1.0, "format": 0.0, "length": 0.0}
    assert long_.components["length"] < 0 and long_.components["format"] == 1.0


def test_make_task_from_config_passes_the_task_fields():
    d = DataConfig(task="countdown", max_operand=20, countdown_min_numbers=4, countdown_max_numbers=4,
                   countdown_max_target=50, prompt_style="compact", seed=3)
    task = make_task_from_config(d)
    assert isinstance(task, CountdownTask) and task.seed == 3
    assert all(len(p.metadata["numbers"]) == 4 and p.metadata["target"] <= 50 for p in task.train_batch(0, 20))
    assert isinstance(make_task_from_config(DataConfig(task="multi")), MultiTask)
    arith = make_task_from_config(DataConfig(max_operand=9))
    assert isinstance(arith, ArithmeticTask) and arith.max_operand == 9
    assert isinstance(make_task("countdown", max_operand=99, seed=0), CountdownTask)  # the trainer's call today


def test_bad_task_settings_are_clear_errors():
    valid = r"\['arithmetic', 'chain', 'constitution', 'countdown', 'multi', 'multiply', 'tool_choice'\]"
    with pytest.raises(KeyError, match=rf"unknown task 'gsm8k'; valid: {valid}"):
        make_task("gsm8k")
    with pytest.raises(ValueError, match="prompt_style must be one of"):
        MultiTask(prompt_style="chat")
    with pytest.raises(ConfigError, match=r"countdown_min_numbers \(5\) must not exceed data.countdown_max_numbers"):
        load_config(None, ["data.task=countdown", "data.countdown_min_numbers=5"])
    with pytest.raises(ValueError, match=r"no eval problem in 10000 draws; .* \(raise data.max_operand or"):
        CountdownTask(max_operand=1, min_numbers=2, max_numbers=2).eval_set(5)
