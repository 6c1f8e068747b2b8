"""fleetrl's final-answer rule against math-verify, the field's grader: completions in the forms models write
(markdown, LaTeX, boxed, Minerva, GSM8K ``####``, prose with units, negative, decimal and fractional answers,
sets and intervals) for many references. fleetrl's verdict must equal math-verify's ``verify(parse(gold),
parse(pred))`` except in the classes of deliberate refusal (:data:`DELIBERATE`, each with its reason in
docs/rewards_and_tasks.md), where fleetrl must refuse what math-verify pays.

``python -m tests.test_differential [checkout]`` prints the agreement of a checkout's rule (before/after numbers).
"""

from __future__ import annotations

import itertools
import logging

import pytest

logging.getLogger("math_verify").setLevel(logging.ERROR)

# reference (LaTeX, as a dataset gives it) -> ways a right answer is written, and a wrong one
NUMBERS = {
    "159": ["159", "159.0", "159.00"], "-32": ["-32", "-32.0"], "14916": ["14916", "14,916", "14{,}916", "14\\,916"],
    "1000000": ["1000000", "1,000,000"], "0.4": ["0.4", ".4", "\\frac{2}{5}", "2/5"],
    "\\frac{1}{3}": ["\\frac{1}{3}", "\\frac13", "\\dfrac{1}{3}", "1/3", "\\tfrac{1}{3}"],
    "\\frac{3}{4}": ["\\frac{3}{4}", "0.75", "\\frac{6}{8}", "3/4", "\\cfrac{3}{4}"],
    "-\\frac{5}{2}": ["-\\frac{5}{2}", "-2.5"],
    "7": ["7"], "0": ["0"], "2.74": ["2.74"], "12": ["12"],
}
EXPRESSIONS = {
    "2\\sqrt{3}": ["2\\sqrt{3}", "\\sqrt{12}", "2 \\sqrt 3"], "x+1": ["x+1", "1+x"],
    "\\frac{\\sqrt{3}}{2}": ["\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"],
    "\\frac{\\pi}{2}": ["\\frac{\\pi}{2}", "\\pi/2"], "[1, 3]": ["[1, 3]", "[1,3]"],
    "(0, \\infty)": ["(0, \\infty)", "(0,\\infty)"], "\\{1, 2\\}": ["\\{1, 2\\}", "\\{2,1\\}"],
    "\\text{Evelyn}": ["\\text{Evelyn}"], "x^2 - 1": ["x^2 - 1", "(x-1)(x+1)"],
}
WRONG = {"159": "158", "-32": "32", "14916": "14961", "1000000": "100000", "0.4": "0.04",
         "\\frac{1}{3}": "\\frac{1}{4}",
         "\\frac{3}{4}": "\\frac{4}{3}", "-\\frac{5}{2}": "\\frac{5}{2}", "7": "8", "0": "1", "2.74": "2.47",
         "12": "21", "2\\sqrt{3}": "3\\sqrt{2}", "x+1": "x-1", "\\frac{\\sqrt{3}}{2}": "\\frac{\\sqrt{2}}{2}",
         "\\frac{\\pi}{2}": "\\pi", "[1, 3]": "(1, 3)", "(0, \\infty)": "[0, \\infty)", "\\{1, 2\\}": "\\{1, 3\\}",
         "\\text{Evelyn}": "\\text{Bob}", "x^2 - 1": "x^2 + 1"}

# forms: {a} is the answer as LaTeX; math forms wrap it in $...$ or a box, plain forms need a plain-text answer
MATH_FORMS = [
    "\\boxed{{{a}}}", "${a}$", "The answer is $\\boxed{{{a}}}$.", "So the answer is ${a}$.",
    "Therefore, the final answer is $\\boxed{{{a}}}$. I hope it is correct.",
    "Final Answer: The final answer is ${a}$. I hope it is correct.",
    "First, \\boxed{{64}} is the first number.\nFinal Answer: The final answer is ${a}$. I hope it is correct.",
    "### Final Answer\n\\boxed{{{a}}}", "## Solution\nWe compute.\n\n**Final Answer:** $\\boxed{{{a}}}$",
    "<think>Let me work it out.</think>\nThe answer is $\\boxed{{{a}}}$.", "We get \\[ {a} \\]",
    "$$\\boxed{{{a}}}$$", "\\(\\boxed{{{a}}}\\)",
]
PLAIN_FORMS = [
    "{a}", "The answer is {a}.", "**{a}**", "The answer is **{a}**.", "**Answer:** {a}", "Answer: {a}",
    "Work it out.\n#### {a}", "64 + 95 = **{a}**", "So the result is {a}.", "*{a}*", "__{a}__",
    "Adding them gives {a} in all.", "The final answer is: {a}",
]
PLAIN = {"159", "-32", "14916", "14,916", "1000000", "1,000,000", "0.4", ".4", "2/5", "1/3", "0.75", "3/4", "-2.5",
         "7", "0", "2.74", "12", "159.0", "159.00", "-32.0", "158", "32", "14961", "100000", "0.04", "8", "1",
         "2.47", "21"}

# deliberate refusals: math-verify pays these, fleetrl does not (docs/rewards_and_tasks.md, "Where fleetrl
# refuses what math-verify pays")
DELIBERATE = {
    "unevaluated computation": ["{x} + {y}", "\\boxed{{{x} + {y}}}", "The answer is {x} + {y}."],
    "list of candidates": ["{w} or {r}", "{w}, {r}", "It is {w} or maybe {r}."],
    "answer only in reasoning": ["<think>The answer is {r}.</think>", "<think>So \\boxed{{{r}}}"],
    "changed its mind": ["The answer is {r}. Wait, no: it is {w}."],
}


def _ints() -> list[tuple[int, int]]:
    return [(64, 95), (100, 59), (7, 5), (1000, 13915)]


def cases() -> list[tuple[str, str, str]]:
    """(class, completion, reference): class ``form`` for ordinary forms, else a :data:`DELIBERATE` class."""
    out = []
    for ref, rights in itertools.chain(NUMBERS.items(), EXPRESSIONS.items()):
        for a in rights + [WRONG[ref]]:
            out += [("form", f.format(a=a), ref) for f in MATH_FORMS]
            if a in PLAIN:
                out += [("form", f.format(a=a), ref) for f in PLAIN_FORMS]
    for x, y in _ints():
        r, w = str(x + y), str(x + y - 1)
        for cls, forms in DELIBERATE.items():
            out += [(cls, f.format(x=x, y=y, r=r, w=w), r) for f in forms]
    return out


def grader_verdict(completion: str, reference: str) -> bool:
    from math_verify import parse, verify

    return bool(verify(parse(f"${reference}$"), parse(completion)))


def fleetrl_verdict(completion: str, reference: str) -> bool:
    from rewards.functions import math_reward

    return math_reward("What is the answer?", completion, {"answer": reference}) == 1.0


def unformatted(completion: str) -> str:
    """The completion without markdown emphasis and headings, and with LaTeX thin spaces between digit groups
    removed: what math-verify misreads (``*159*``, ``__159__``, ``The answer is **2/5**.``, ``14\\,916``)."""
    from rewards.answers import strip_markdown

    return strip_markdown(completion).replace("\\,", "")


def formatting_only(completion: str, reference: str, fleetrl: bool) -> bool:
    """Whether a disagreement is math-verify misreading formatting: on the unformatted completion it agrees."""
    return grader_verdict(unformatted(completion), reference) == fleetrl


def agreement() -> dict:
    """How fleetrl's verdicts compare with math-verify's over :func:`cases`."""
    forms = [(c, r, grader_verdict(c, r), fleetrl_verdict(c, r)) for cls, c, r in cases() if cls == "form"]
    deliberate = [(cls, c, r, grader_verdict(c, r), fleetrl_verdict(c, r)) for cls, c, r in cases() if cls != "form"]
    disagree = [(c, r, g, f) for c, r, g, f in forms if g != f]
    return {"forms": len(forms), "forms_agree": len(forms) - len(disagree),
            "formatting_only": sum(formatting_only(c, r, f) for c, r, _, f in disagree),
            "disagree": [(c, r, g, f) for c, r, g, f in disagree if not formatting_only(c, r, f)],
            "deliberate": len(deliberate), "deliberate_refused": sum(not f for *_, f in deliberate),
            "deliberate_grader_pays": sum(g for *_, g, _ in deliberate)}


@pytest.mark.parametrize("cls,completion,reference", [c for c in cases() if c[0] == "form"])
def test_fleetrl_agrees_with_math_verify(cls, completion, reference):
    """Equal verdicts, or math-verify misreads formatting (it agrees once the markdown is gone): the only listed
    class where fleetrl pays what math-verify refuses."""
    fleetrl = fleetrl_verdict(completion, reference)
    assert fleetrl == grader_verdict(completion, reference) or formatting_only(completion, reference, fleetrl)


@pytest.mark.parametrize("cls,completion,reference", [c for c in cases() if c[0] != "form"])
def test_deliberate_refusals_are_refused(cls, completion, reference):
    assert cls in DELIBERATE and not fleetrl_verdict(completion, reference)


def test_every_deliberate_class_is_one_math_verify_pays():
    """A listed class must really differ from the grader: otherwise it is not a deliberate refusal."""
    for cls in DELIBERATE:
        paid = [grader_verdict(c, r) for k, c, r in cases() if k == cls]
        assert any(paid), cls


def test_the_forms_cover_rights_and_wrongs():
    verdicts = [grader_verdict(c, r) for k, c, r in cases() if k == "form"]
    assert 0.3 < sum(verdicts) / len(verdicts) < 0.95 and len(verdicts) > 500


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) > 1:
        sys.path.insert(0, sys.argv[1])
    print(json.dumps(agreement(), indent=1))
