"""Hostile completions for every registered verifier: what a policy can learn in order to be paid without solving
the problem must score 0, and right answers in every accepted form must score 1 (``tests/test_sandbox.py`` does
the same for code). Each case was seen failing once against the old verifier, which rewarded any expression
equal to the answer ("What is 64 + 95?" -> "64 + 95" scored 1.0)."""

import pytest

from rewards.answers import final_answer, matches
from rewards.functions import REWARD_FUNCTIONS, is_correct, load_builtins
from rewards.tasks import ChainTask, CountdownTask, MultiplyTask

load_builtins()
ADD = "What is 64 + 95?"
ADD_META = {"answer": "159"}


# ---- math: the hostile table, then every accepted form ------------------------------------------------------------
@pytest.mark.parametrize("completion,reference,expected", [
    ("64 + 95", "159", 0.0),
    ("64 + 95 =", "159", 0.0),
    ("\\boxed{64+95}", "159", 0.0),
    ("158 or 159", "159", 0.0),
    ("157, 158, 159", "159", 0.0),
    ("x = 159", "159", 1.0),
    ("#### 3*4", "12", 0.0),
    ("1/2 + 1/4", "3/4", 0.0),
    ("2\\sqrt{3}", "2\\sqrt{3}", 1.0),
])
def test_the_issue_table_flips(completion, reference, expected):
    assert REWARD_FUNCTIONS["math"](ADD, completion, {"answer": reference}) == expected


@pytest.mark.parametrize("completion,reference", [
    ("159", "159"), (" 159\n", "159"), ("-32", "-32"), ("159.0", "159"), ("3/4", "3/4"), ("\\frac{3}{4}", "3/4"),
    ("0.75", "3/4"), ("\\boxed{159}", "159"), ("$159$", "159"), ("The answer is 159.", "159"),
    ("Answer: 159", "159"), ("work\n#### 1,234", "1234"), ("64 + 95 = 159", "159"), ("64 + 95 = 159.", "159"),
    ("The sum of 64 and 95 is 159.", "159"), ("<think>60+90=150, 4+5=9</think> 159", "159"),
    ("It fell to -7 degrees overnight.", "-7"), ("So it takes \\boxed{70} days.", "70"),
    ("159 (because 64 + 95 = 159)", "159"), ("\\boxed{159} so \\boxed{159.0}", "159"),
    ("I first wrote \\boxed{5}, a slip.\n#### 18", "18"), ("\\boxed{\\dfrac{1}{2}}", "0.5"),
    ("\\boxed{x+1}", "x+1"), ("The answer is $2\\sqrt{3}$.", "2\\sqrt{3}"), ("[1, 3]", "[1,3]"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"), ("64 + 95 = 159.\n\nI hope this helps!", "159"),
])
def test_right_answers_in_every_accepted_form_score_1(completion, reference):
    assert REWARD_FUNCTIONS["math"](ADD, completion, {"answer": reference}) == 1.0


@pytest.mark.parametrize("completion,reference", [
    ("**159**", "159"), ("The answer is **159**.", "159"), ("64 + 95 = **159**", "159"), ("**Answer:** 159", "159"),
    ("\\boxed{14{,}916}", "14916"), ("$\\frac13$", "1/3"), (".4", "0.4"), ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}"),
    ("Therefore $\\frac{6}{8}$", "\\frac{3}{4}"),
    ("So \\boxed{64} is the first number. Final Answer: The final answer is $159$. I hope it is correct.", "159"),
    ("### Final Answer\n\\boxed{159}", "159"), ("*159*", "159"), ("$\\boxed{11,\\! 111}$", "11111"),
    ("\\boxed{1}, \\boxed{2}", "\\{1, 2\\}"), ("0.333333", "1/3"),
])
def test_right_answers_in_the_forms_chat_models_write(completion, reference):
    """Each scored 0 under the earlier final-answer rule (markdown read as multiplication, the box before an explicit
    final statement, LaTeX digit groups, shorthand fractions, unreduced fractions, sets as one box per element)."""
    assert REWARD_FUNCTIONS["math"](ADD, completion, {"answer": reference}) == 1.0


@pytest.mark.parametrize("completion,reference", [
    ("$\\frac{1+\\sqrt{5}}{2}$", "2"), ("AZYUK2A", "2"), ("x2", "2"), ("$10^{10}$", "10"), ("1000,99", "1000"),
    ("\\boxed{318/2}", "159"), ("Reduce 6/8: 6/8", "\\frac{3}{4}"), ("158 or maybe 159", "159"), ("0.333", "1/3"),
])
def test_wrong_answers_the_earlier_rule_paid_are_not_paid(completion, reference):
    """The first two were paid under the earlier final-answer rule (the denominator, a digit inside a word)."""
    assert REWARD_FUNCTIONS["math"]("Reduce 6/8.", completion, {"answer": reference}) == 0.0


ENORMOUS = "1 " * 60_000 + "159"
MATH_HOSTILE = [
    "What is 64 + 95?",  # the prompt restated
    "64 + 95", "64+95", "\\boxed{64 + 95}", "$64 + 95$", "160 - 1", "100 + 59 =", "3 * 53",
    "158 or 159", "157, 158, 159", "159 or 160", "between 158 and 159", "158/159",
    " ".join(map(str, range(200))), "\n".join(map(str, range(200))), ";".join(map(str, range(200))),
    "<think>64 + 95 = 159</think>", "<think>64 + 95 = 159", "<think>so 159</think> I am not sure.",
    "\\boxed{159} and \\boxed{158}", "The answer is 159. Wait, no: 158.", "159. Actually it is 160.",
    "１５９", "١٥٩", "", "   ", ENORMOUS, "159" * 2000,
    "318/2", "\\frac{318}{2}", "159 + 0", "#### 159 + 0", "0 + 159", "1 * 159", "159 * (1)", "159 *",
    "\\boxed{159 \\times 1}", "\\boxed{158} and then \\boxed{159}", "159 x 1",
]


@pytest.mark.parametrize("completion", MATH_HOSTILE)
def test_math_hostile_completions_score_0(completion):
    assert REWARD_FUNCTIONS["math"](ADD, completion, ADD_META) == 0.0


def test_a_symbolic_answer_restating_the_prompt_is_no_answer():
    prompt = "Simplify \\sqrt{12}. Put the answer in \\boxed{}."
    assert not matches("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", prompt=prompt)
    assert matches("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", prompt=prompt)


def test_answer_form_forces_the_rule():
    assert matches("\\boxed{12/4}", "3", form="expression") and not matches("\\boxed{12/4}", "3", form="number")
    assert REWARD_FUNCTIONS["math"]("q", "\\boxed{12/4}", {"answer": "3", "answer_form": "expression"}) == 1.0
    with pytest.raises(ValueError, match="answer form"):
        matches("1", "1", form="numeric")
    with pytest.raises(ValueError, match="numeric reference"):
        matches("x", "x+1", form="number")


def test_final_answer_is_the_value_written_last():
    assert final_answer("64 + 95 = 159").value == 159
    assert final_answer("The answer is -3/4.").value == -0.75
    assert final_answer("64 + 95 =") is None and final_answer("158 or 159") is None


# ---- countdown -----------------------------------------------------------------------------------------------------
COUNTDOWN = {"answer": "24", "numbers": [3, 5, 7, 9], "target": 24}


@pytest.mark.parametrize("completion", [
    "<answer>24</answer>",  # the target restated
    CountdownTask().prompt([3, 5, 7, 9], 24),  # the whole prompt restated
    "<answer>3*8</answer>", "<answer>(9 - 7) * 3 * 5</answer> = 24", "<answer>9+7+5+3</answer><answer>1</answer>",
    "<answer>3*8</answer><answer>9+7+5+3</answer>",
    "<think><answer>9+7+5+3</answer></think>", "<think><answer>9+7+5+3</answer>", "3 5 7 9 24", "",
    "<answer>" + "+".join(["1"] * 5000) + "</answer>", "<answer>９+７+５+３</answer>",
])
def test_countdown_hostile(completion):
    assert REWARD_FUNCTIONS["countdown"]("q", completion, COUNTDOWN) == 0.0


@pytest.mark.parametrize("completion", ["<answer>9+7+5+3</answer>", "<think>try</think><answer>(9+7)+(5+3)</answer>",
                                        "9+7+5+3 = 24", "<answer>9+7+5+3</answer> <answer> 9 + 7 + 5 + 3 </answer>"])
def test_countdown_right(completion):
    assert REWARD_FUNCTIONS["countdown"]("q", completion, COUNTDOWN) == 1.0


# ---- chain -----------------------------------------------------------------------------------------------------------
CHAIN = {"answer": "70", "terms": [12, 30, 7, 21], "steps": ["42", "49", "70"]}


@pytest.mark.parametrize("completion", [
    "12+30+7+21=", "12+30+7+21", ";".join(map(str, range(71))), "\n".join(map(str, range(71))),
    " ".join(map(str, range(71))), "42;49;69 or 70", "<think>42;49;70</think>", "42;49;70;71", "42;49;70 71",
    "", "７０", "42;49;49+21",
])
def test_chain_hostile(completion):
    assert REWARD_FUNCTIONS["chain"]("12+30+7+21=", completion, CHAIN) == 0.0


@pytest.mark.parametrize("completion", ["42;49;70", "42\n49\n70", "12+30=42\n42+7=49\n49+21=70",
                                        "<think>x</think>42;49;70"])
def test_chain_right(completion):
    assert REWARD_FUNCTIONS["chain"]("12+30+7+21=", completion, CHAIN) == 1.0
    assert ChainTask().answer_key(completion) == "70"


# ---- choice ----------------------------------------------------------------------------------------------------------
CHOICE_PROMPT = "Which is prime?\nA) 4\nB) 6\nC) 7\nD) 9\nAnswer with the letter."


@pytest.mark.parametrize("completion", [
    CHOICE_PROMPT, "A B C D", "A, B, C or D", "C or D", "The answer is C or D.", "\\boxed{C} \\boxed{D}",
    "<think>C</think>", "<think>C", "", "D) 9", "The answer is C. No wait, D.",
])
def test_choice_hostile(completion):
    assert REWARD_FUNCTIONS["choice"](CHOICE_PROMPT, completion, {"answer": "C"}) == 0.0


@pytest.mark.parametrize("completion", ["C", "(C)", "The answer is C.", "I think B, no, the answer is C.",
                                        "\\boxed{C}", "<think>A is 4</think> C", "A prime has two divisors.\nC"])
def test_choice_right(completion):
    assert REWARD_FUNCTIONS["choice"](CHOICE_PROMPT, completion, {"answer": "C"}) == 1.0


# ---- format ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("completion", [
    "What is 64 + 95?", "159", "<think>64 + 95 = 159</think>", "<think></think> 159", "<think>  </think> 159",
    "<think>a</think><think>b</think> 159", "<think>a</think> 159 <think>", "159 <think>x</think>", "",
    "<think>" + "x" * 200_000 + "</think> 159",
])
def test_format_hostile(completion):
    assert REWARD_FUNCTIONS["format"](ADD, completion, {}) == 0.0


def test_format_right():
    assert REWARD_FUNCTIONS["format"](ADD, "<think>64 + 95 = 159</think> 159", {}) == 1.0


# ---- the tool task's outcome check (multiply: the `math` verifier on the episode's final answer) --------------------
@pytest.mark.parametrize("completion", [
    "What is 347 * 58? Use the calculator tool, then reply with the number only.", "347 * 58", "[347*58]",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "347*58"}}</tool_call>', "20126 or 20127",
    "{20126} 20125",
])
def test_tool_task_hostile(completion):
    task = MultiplyTask(prompt_style="text")
    meta = {"answer": "20126", "a": 347, "b": 58}
    assert not is_correct(task.verifier_fn, "What is 347 * 58?", completion, meta)


def test_tool_task_right():
    task = MultiplyTask(prompt_style="text")
    for completion in ("20126", "The product is 20126.", "347 * 58 = 20126"):
        assert is_correct(task.verifier_fn, "What is 347 * 58?", completion, {"answer": "20126"})
