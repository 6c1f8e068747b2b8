r"""The final-answer rule: what a completion answers, decided in one place.

Every correctness decision in fleetrl (the ``math`` reward, ``train/accuracy``, held-out evals, ``fleetrl eval``,
the RFT, cold-start and distillation filters, search's majority vote) reads a completion's answer through
:func:`final_answer` and compares it with :func:`matches`. The rule is what graders mean by "the answer" (GSM8K:
the number; MATH: one boxed expression, equivalent), not "some expression in the completion equals the answer":

1. **Where the answer is stated** (:func:`answer_region`). Reasoning (``<think>...</think>``) is not the answer:
   only what follows the last ``</think>`` counts, and an unclosed ``<think>`` has no answer. In that text the
   most explicit statement wins: the line after the last ``####`` (GSM8K); else the ``\boxed{}`` contents (several
   boxes must agree); else the last ``<answer>...</answer>``; else what follows the last "answer is" /
   "answer:"; else the whole text.
2. **A numeric reference** (an integer, decimal or fraction: ``159``, ``-32``, ``0.75``, ``3/4``,
   ``\frac{3}{4}``) **needs a numeral** (:func:`final_number`): the last number of the stated answer, after the
   last ``=`` (so a computation that ends in its value, ``64 + 95 = 159``, answers 159). It is no answer when it
   is an operand of an unevaluated computation (``64 + 95``, ``64 + 95 =``, ``3*4``, ``1/2 + 1/4``), or the end
   of a list of candidates (``158 or 159``, ``157, 158, 159``, ``0 1 2 ... 200``), or a fraction not in lowest
   terms (``12/4``). Only ASCII digits are numerals. Values compare exactly (``159.0`` = ``159``, ``0.75`` =
   ``3/4``).
3. **A symbolic reference** (``2\sqrt{3}``, ``x+1``, an interval) keeps math-verify's equivalence
   (:func:`final_expression`); LaTeX written without delimiters is understood. Restating an expression of the
   prompt (``\sqrt{12}`` for "Simplify \sqrt{12}") is no answer.

``form`` (``data.answer_form``) forces the rule: ``number``, ``expression``, or ``auto`` (by the reference).
math-verify parses LaTeX and decides symbolic equivalence; this module decides which text is the answer.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, get_args

AnswerForm = Literal["auto", "number", "expression"]
ANSWER_FORMS: tuple[str, ...] = get_args(AnswerForm)

MAX_COMPLETION_CHARS = 100_000
"""A completion longer than this has no answer (it is not read: the rule stays cheap on hostile input)."""
MAX_NUMERAL_DIGITS = 300
"""Longer digit runs are not numerals (``int()`` of a huge string is slow, and no reference is that long)."""


@dataclass(frozen=True)
class FinalAnswer:
    """A completion's final answer: the text it was read from, and its exact value when it is a number."""

    text: str
    value: Fraction | None = None

    @property
    def key(self) -> str:
        """A canonical string for voting: equal numbers share a key (``159.0`` and ``159``)."""
        return str(self.value) if self.value is not None else re.sub(r"\s+", "", self.text)


# ---- 1. where the answer is stated ------------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_ANSWER_IS = re.compile(r"\banswer\s*(?:is|:|=)\s*:?", re.I)
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def final_text(completion: str) -> str | None:
    """What follows the last ``</think>`` (the whole completion when it has no think block), stripped; None when
    a ``<think>`` is never closed (truncated reasoning states no answer) or the completion is enormous."""
    if len(completion) > MAX_COMPLETION_CHARS:
        return None
    head, closed, tail = completion.rpartition("</think>")
    if not closed:
        return None if "<think>" in completion else completion.strip()
    return tail.strip()


def boxed_contents(text: str) -> list[str]:
    r"""The contents of every ``\boxed{...}`` / ``\fbox{...}`` in ``text`` (braces balanced), in order."""
    out = []
    for m in _BOX_OPEN.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end():i - 1].strip())
    return out


def answer_regions(completion: str) -> list[str] | None:
    """The places where ``completion`` states its final answer, most explicit first found (see the module
    docstring): one region, or every ``\\boxed{}``'s contents (which must agree); None when there is none."""
    text = final_text(completion)
    if not text:
        return None
    if "####" in text:
        ending = text.rpartition("####")[2].split("\n", 1)[0].strip()
        return [ending] if ending else None
    boxes = boxed_contents(text)
    if boxes:
        return boxes
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return [tags[-1].strip()]
    said = list(_ANSWER_IS.finditer(text))
    if said:
        return [text[said[-1].end():].strip()]
    return [text]


# ---- 2. numbers ---------------------------------------------------------------------------------------------------

_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?[0-9]+)\s*\}\s*\{\s*([0-9]+)\s*\}")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_LATEX_NOISE = re.compile(r"\\[(),!;\[\]]|\\left|\\right|\$|\\%")
_LATEX_OPS = {r"\times": "*", r"\cdot": "*", r"\div": "/", r"\pm": "+", "×": "*", "÷": "/", "−": "-", "·": "*"}
_NUMERAL = re.compile(r"(?<![0-9.,])(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?![0-9])")
_TRAILING_PAREN = re.compile(r"\s*\([^()]*\)[\s.!]*$")
_OPERATOR_BEFORE = re.compile(r"(?:[0-9)]\s*(?:[-+*/^x])|[+*/^])\s*$")
_SIGN_BEFORE = re.compile(r"-\s*$")
_LIST_BEFORE = re.compile(r"[0-9)]\s*(?:,|;|/|\||\bor\b|\band\b|\bthen\b|\bto\b|\.\.\.|…)?\s*$", re.I)
_OPERATOR_AFTER = re.compile(r"^\s*(?:\*\*|[-+*/^]|x\s*[0-9(])")


def _clean_math(text: str) -> str:
    r"""LaTeX and typographic wrappers removed (``$``, ``\(``, ``\text{}``), ``\frac{a}{b}`` as ``a/b``, operator
    symbols as ASCII."""
    text = _LATEX_TEXT.sub(r" \1 ", text)
    text = _LATEX_FRAC.sub(r"\1/\2", text)
    for symbol, ascii_op in _LATEX_OPS.items():
        text = text.replace(symbol, f" {ascii_op} ")
    return _LATEX_NOISE.sub(" ", text)


def parse_number(text: str) -> Fraction | None:
    r"""The value of a bare numeral (``159``, ``-32``, ``1,234``, ``0.75``, ``3/4``, ``\frac{3}{4}``), else None."""
    s = _clean_math(text).strip().rstrip(".")
    m = re.fullmatch(r"(-?)\s*([0-9,]+(?:\.[0-9]+)?)(?:\s*/\s*([0-9]+))?", s)
    if not m or not _NUMERAL.fullmatch(m.group(2)) or len(s) > MAX_NUMERAL_DIGITS:
        return None
    value = Fraction(m.group(2).replace(",", ""))
    if m.group(3):
        if int(m.group(3)) == 0:
            return None
        value /= int(m.group(3))
    return -value if m.group(1) else value


def final_number(region: str) -> FinalAnswer | None:
    """The one number ``region`` answers with (rule 2 of the module docstring), or None."""
    text = _clean_math(region)
    if "=" in text:
        text = text.rpartition("=")[2]
    text = text.strip().rstrip(".!?:;, ")
    stripped = _TRAILING_PAREN.sub("", text)
    if _NUMERAL.search(stripped):
        text = stripped  # "159 (because 64 + 95 = 159)" answers 159
    numerals = list(_NUMERAL.finditer(text))
    if not numerals:
        return None
    last = numerals[-1]
    if len(last.group()) > MAX_NUMERAL_DIGITS or _OPERATOR_AFTER.match(text[last.end():]):
        return None
    start, value = last.start(), Fraction(last.group().replace(",", ""))
    before = text[:start]
    denominator_of = re.search(r"(?<![0-9.,])([0-9]+)\s*/\s*$", before)
    if denominator_of and "." not in last.group() and "," not in last.group():  # a fraction a/b
        numerator = int(denominator_of.group(1))
        if int(last.group()) == 0 or math.gcd(numerator, int(last.group())) != 1:
            return None  # 12/4, 6/8: a division left undone
        value, start = Fraction(numerator, int(last.group())), denominator_of.start()
        before = text[:start]
    if _SIGN_BEFORE.search(before) and not re.search(r"[0-9)]\s*-\s*$", before):
        value, before = -value, _SIGN_BEFORE.sub("", before)
    if _OPERATOR_BEFORE.search(before) or _LIST_BEFORE.search(before):
        return None  # an operand of a computation left undone, or the last of several candidates
    return FinalAnswer(text[start:last.end()].strip(), value)


# ---- 3. expressions ---------------------------------------------------------------------------------------------

_WORD = re.compile(r"[A-Za-z]{3,}")


def final_expression(region: str) -> FinalAnswer | None:
    r"""The expression ``region`` answers with, parsed by math-verify (LaTeX with or without delimiters, plain
    expressions); the value (``text``) is math-verify's matched string. A region without ``$`` and without words
(``2\sqrt{3}``, ``x+1``, ``[1, 3]``) is read as one LaTeX expression."""
    bare_math = "$" not in region and not _WORD.search(re.sub(r"\\[A-Za-z]+", " ", region))
    parsed = (parse_math(f"${region}$") if bare_math else []) or parse_math(region)
    if not parsed:
        return None
    return FinalAnswer(str(parsed[-1]))


def parse_math(text: str) -> list:
    """math-verify's ``parse`` with LaTeX and plain-expression extraction, without its signal-based timeout
    (reward functions run in non-main threads of Ray actors, where ``signal.alarm`` fails; the reward worker's own
    timeout bounds a call)."""
    from math_verify import parse

    return parse(text, extraction_config=_extraction_config(), parsing_timeout=None)


@functools.cache
def _extraction_config() -> tuple:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return (LatexExtractionConfig(), ExprExtractionConfig())


@functools.lru_cache(maxsize=4096)
def _parse_reference(reference: str) -> list:
    """A reference answer parsed as one LaTeX expression (cached: a prompt's G samples share it)."""
    from math_verify import parse

    return parse(f"${reference}$", parsing_timeout=None)


def expressions_equal(given: str, reference: str) -> bool:
    """math-verify's equivalence of two expressions written as LaTeX (with or without ``$``)."""
    from math_verify import verify

    gold, pred = _parse_reference(reference), _parse_reference(given)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def _squeeze(text: str) -> str:
    return re.sub(r"[\s$]+", "", text)


# ---- the rule ---------------------------------------------------------------------------------------------------

def resolve_form(reference: str, form: str = "auto") -> str:
    """``number`` or ``expression``: the form a reference asks for (``auto``: ``number`` for a plain numeral)."""
    if form not in ANSWER_FORMS:
        raise ValueError(f"answer form must be one of {ANSWER_FORMS}, got {form!r}")
    if form != "auto":
        return form
    return "number" if parse_number(reference) is not None else "expression"


def final_answer(completion: str, form: str = "number", prompt: str = "") -> FinalAnswer | None:
    """The completion's one final answer in ``form`` (``number`` | ``expression``), or None when it states none,
    several that disagree, or (``expression``) one that restates an expression of ``prompt``."""
    regions = answer_regions(completion)
    if not regions:
        return None
    read = final_number if form == "number" else final_expression
    answers = [read(r) for r in regions]
    if any(a is None for a in answers) or len({a.key for a in answers}) > 1:
        if form == "number" or not _all_equivalent(answers):
            return None
    answer = answers[-1]
    if form == "expression" and prompt and _restates(answer, regions[-1], prompt):
        return None
    return answer


def _all_equivalent(answers: list[FinalAnswer | None]) -> bool:
    return all(a is not None for a in answers) and all(expressions_equal(a.text, answers[-1].text) for a in answers)


def _restates(answer: FinalAnswer, region: str, prompt: str) -> bool:
    """Whether the answer is an expression copied from the prompt (a computation handed back, not done)."""
    written = _squeeze(region)
    return len(written) > 1 and bool(re.search(r"[-+*/^\\]", written)) and written in _squeeze(prompt)


def matches(completion: str, reference: str, form: str = "auto", prompt: str = "") -> bool:
    """Whether the completion's final answer (:func:`final_answer`) is the reference: equal numbers for a numeric
    reference, math-verify equivalence for a symbolic one."""
    reference = str(reference).strip()
    form = resolve_form(reference, form)
    expected = parse_number(reference) if form == "number" else None
    if form == "number" and expected is None:
        raise ValueError(f"answer form 'number' needs a numeric reference answer, got {reference!r}")
    answer = final_answer(completion, form, prompt)
    if answer is None:
        return False
    if form == "number":
        return answer.value == expected
    return _squeeze(answer.text) == _squeeze(reference) or expressions_equal(answer.text, reference)


def vote_key(completion: str, form: str = "auto") -> str | None:
    """The completion's final answer in ``form`` as a canonical string for majority voting (a number's exact
    value, an expression's text; ``auto``: a number, else an expression), None when it states none."""
    answer = None if form == "expression" else final_answer(completion, "number")
    if answer is None and form != "number":
        answer = final_answer(completion, "expression")
    return answer.key if answer else None
