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
_BOLD = re.compile(r"(?<![\w\\*])(\*\*|__)(?=[^\s*_])(.+?)(?<=[^\s*_])\1(?![\w*])")
_EMPHASIS = re.compile(r"(?<![\w\\*)\]])\*(?=[^\s*])([^*\n]+?)(?<=[^\s*])\*(?![\w*(])")
_HEADING = re.compile(r"^[ \t]*(?:#{1,3}|#{5,6}|####(?=[^\n0-9]*$))[ \t]+", re.M)
_MATHY = re.compile(r"[0-9$\\]")
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)


def strip_markdown(text: str) -> str:
    """Markdown emphasis (``**159**``, ``__159__``, ``*159*``) and heading marks (``### Final Answer``) removed: they
    are formatting, never operators. A ``####`` line holding a digit stays (GSM8K's answer marker); ``3**2`` and
    ``3*4*5`` stay (operators between operands)."""
    for _ in range(3):  # ***159*** is bold inside emphasis
        text = _EMPHASIS.sub(r"\1", _BOLD.sub(r"\2", text))
    return _HEADING.sub("", text)


def final_text(completion: str) -> str | None:
    """What follows the last ``</think>`` (the whole completion when it has no think block), stripped, markdown
    removed; None when a ``<think>`` is never closed (truncated reasoning states no answer) or the completion is
    enormous."""
    if len(completion) > MAX_COMPLETION_CHARS:
        return None
    head, closed, tail = completion.rpartition("</think>")
    if not closed:
        return None if "<think>" in completion else strip_markdown(completion.strip())
    return strip_markdown(tail.strip())


def _box_spans(text: str) -> list[tuple[int, int]]:
    r"""(start, end) of the contents of every outermost ``\boxed{...}`` / ``\fbox{...}`` (braces balanced), in
    order: one pass over the text, so deeply nested boxes cost linear time."""
    opens = {m.end() - 1 for m in _BOX_OPEN.finditer(text)}
    spans: list[tuple[int, int]] = []
    depth, box_depth, start = 0, 0, 0  # box_depth: the depth of the open outermost box's brace, 0 when none
    for i in (range(len(text)) if opens else ()):
        if text[i] == "{":
            depth += 1
            if not box_depth and i in opens:
                box_depth, start = depth, i + 1
        elif text[i] == "}" and depth:
            if depth == box_depth:
                spans.append((start, i))
                box_depth = 0
            depth -= 1
    return spans


def boxed_contents(text: str) -> list[str]:
    r"""The contents of every outermost ``\boxed{...}`` / ``\fbox{...}`` in ``text`` (braces balanced), in order."""
    return [text[a:b].strip() for a, b in _box_spans(text)]


def answer_regions(completion: str) -> list[str] | None:
    """The places where ``completion`` states its final answer, most explicit first found (see the module
    docstring): one region, or every ``\\boxed{}``'s contents (which must agree); None when there is none."""
    text = final_text(completion)
    if not text:
        return None
    if "####" in text:
        ending = text.rpartition("####")[2].split("\n", 1)[0].strip()
        return [ending] if ending else None
    spans = _box_spans(text)
    said = list(_ANSWER_IS.finditer(text))
    stated = text[said[-1].end():].strip() if said else ""
    span = _MATH_SPAN.match(stated)
    if span:  # "The final answer is $159$. I hope it is correct." (Minerva): the math that follows the statement
        stated = next(g for g in span.groups() if g is not None).strip()
    if spans and not (said and said[-1].start() > spans[-1][1] and _MATHY.search(stated)):
        return [text[a:b].strip() for a, b in spans]  # a final statement (with some math) after the last box wins
    tags = _ANSWER_TAG.findall(text)
    if tags and not spans:
        return [tags[-1].strip()]
    return [stated] if stated else [text]


# ---- 2. numbers ---------------------------------------------------------------------------------------------------

_LATEX_FRAC = re.compile(r"\\[dtc]?frac\s*\{\s*(-?[0-9]+)\s*\}\s*\{\s*([0-9]+)\s*\}")
_LATEX_FRAC_SHORT = re.compile(r"\\([dtc]?frac)\s*(?:([0-9])\s*([0-9])|([0-9])\s*(\{[^{}]*\})|(\{[^{}]*\})\s*([0-9]))")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_LATEX_NOISE = re.compile(r"\\[(),!;\[\]]|\\left|\\right|\$|\\%")
_LATEX_OPS = {r"\approx": "=", "≈": "=",
              r"\times": "*", r"\cdot": "*", r"\div": "/", r"\pm": "+", "×": "*", "÷": "/", "−": "-", "·": "*"}
_DIGIT_GROUP = re.compile(r"(?<=[0-9])\s*(?:\{\s*,\s*\}|,\s*\\!|\\,|\\ |~|\u2009|\u202f)\s*(?=[0-9]{3}(?![0-9]))")
_NUMERAL = re.compile(r"(?<![0-9.,])(?:(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)(?![0-9])")
_TRAILING_PAREN = re.compile(r"\s*\([^()]*\)[\s.!]*$")
_OPERATOR_BEFORE = re.compile(r"(?:[0-9)]\s*(?:[-+*/^x])|[+*/^])\s*$")
_SIGN_BEFORE = re.compile(r"-\s*$")
_LIST_BEFORE = re.compile(r"[0-9)]\s*(?:,|;|/|\||\bor\b|\band\b|\bthen\b|\bto\b|\.\.\.|…)?"
                          r"(?:\s*\b(?:maybe|perhaps|possibly|probably)\b)?\s*$", re.I)
_OPERATOR_AFTER = re.compile(r"^\s*(?:\*\*|[-+*/^]|x\s*[0-9(])")
_GLUED_BEFORE = re.compile(r"(?:[A-Za-z_\\]|[{}^]\s*)\Z")  # AZYUK2, x2, \frac{1+\sqrt{5}}{2}, 10^{10}; \Z: a
# letter at the end of the line before ("### Final answer\n159") is not glued to the number
_GLUED_AFTER = re.compile(r"^(?:\s*[{}^_]|[A-Z]|,[0-9])")  # 2A, 2^{10}, 1000,99 (a decimal comma)
ROUNDED_PLACES = 6
"""A decimal answer with at least this many places that is the reference rounded to its places is right
(``0.333333`` for 1/3), as math-verify's default ``float_rounding``; fewer places are another number."""


def _clean_math(text: str) -> str:
    r"""LaTeX and typographic wrappers removed (``$``, ``\(``, ``\text{}``), ``\frac{a}{b}`` (also ``\frac13``,
    ``\dfrac``, ``\cfrac``) as ``a/b``, digit-group separators (``14{,}916``, ``14\,916``) as ``,``, operator
    symbols as ASCII."""
    text = _LATEX_TEXT.sub(r" \1 ", text)
    text = _LATEX_FRAC_SHORT.sub(lambda m: "\\frac" + "".join(
        g if g.startswith("{") else "{" + g + "}" for g in m.groups()[1:] if g), text)
    text = _LATEX_FRAC.sub(r"\1/\2", text)
    text = _DIGIT_GROUP.sub(",", text)
    for symbol, ascii_op in _LATEX_OPS.items():
        text = text.replace(symbol, f" {ascii_op} ")
    return _LATEX_NOISE.sub(" ", text)


def parse_number(text: str) -> Fraction | None:
    r"""The value of a bare numeral (``159``, ``-32``, ``1,234``, ``0.75``, ``.4``, ``3/4``, ``\frac{3}{4}``),
    else None."""
    s = _clean_math(text).strip().rstrip(".")
    m = re.fullmatch(r"(-?)\s*([0-9,]*(?:\.[0-9]+)?)(?:\s*/\s*([0-9]+))?", s)
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
    after = text[last.end():]
    if len(last.group()) > MAX_NUMERAL_DIGITS or _OPERATOR_AFTER.match(after) or _GLUED_AFTER.match(after):
        return None
    start, value = last.start(), Fraction(last.group().replace(",", ""))
    before = text[:start]
    denominator_of = re.search(r"(?<![0-9.,])([0-9]+)\s*/\s*$", before)
    if denominator_of and "." not in last.group() and "," not in last.group():  # a fraction a/b
        numerator, denominator = int(denominator_of.group(1)), int(last.group())
        if denominator == 0 or numerator % denominator == 0:
            return None  # 12/4, 318/2: a division left undone
        value, start = Fraction(numerator, denominator), denominator_of.start()
        before = text[:start]
    if _SIGN_BEFORE.search(before) and not re.search(r"[0-9)]\s*-\s*$", before):
        value, before = -value, _SIGN_BEFORE.sub("", before)
    if _OPERATOR_BEFORE.search(before) or _LIST_BEFORE.search(before) or _GLUED_BEFORE.search(before):
        return None  # an operand of a computation left undone, the last of several candidates, part of a word
    return FinalAnswer(text[start:last.end()].strip(), value)


def numbers_equal(answer: FinalAnswer, expected: Fraction) -> bool:
    """Exact equality, or a decimal of at least :data:`ROUNDED_PLACES` places that is ``expected`` rounded."""
    if answer.value == expected:
        return True
    places = len(answer.text.rpartition(".")[2]) if "." in answer.text else 0
    return places >= ROUNDED_PLACES and round(expected, places) == answer.value


# ---- 3. expressions ---------------------------------------------------------------------------------------------

_WORD = re.compile(r"[A-Za-z]{3,}")
_LATEX_WORDS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname|begin|end)\s*\{[^{}]*\}"
                          r"|\\[A-Za-z]+")


def final_expression(region: str) -> FinalAnswer | None:
    r"""The expression ``region`` answers with, parsed by math-verify (LaTeX with or without delimiters, plain
    expressions); the value (``text``) is math-verify's matched string. A region without ``$`` and without words
(``2\sqrt{3}``, ``x+1``, ``[1, 3]``) is read as one LaTeX expression."""
    bare_math = "$" not in region and not _WORD.search(_LATEX_WORDS.sub(" ", region))
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
    several that disagree, or one that restates a computation of ``prompt`` (a fraction or an expression copied
    from it)."""
    regions = answer_regions(completion)
    if not regions:
        return None
    read = final_number if form == "number" else final_expression
    answers = [read(r) for r in regions]
    if any(a is None for a in answers) or len({a.key for a in answers}) > 1:
        if form == "number":
            return None
        if not _all_equivalent(answers):  # one box per element of a set: the set
            return final_expression(", ".join(regions)) if len(regions) > 1 else None
    answer = answers[-1]
    if prompt and _restates(answer.text if form == "number" else regions[-1], prompt):
        return None
    return answer


def _all_equivalent(answers: list[FinalAnswer | None]) -> bool:
    return all(a is not None for a in answers) and all(expressions_equal(a.text, answers[-1].text) for a in answers)


def _restates(written: str, prompt: str) -> bool:
    """Whether the answer is a computation copied from the prompt (``\\sqrt{12}`` for "Simplify \\sqrt{12}",
    ``6/8`` for "Reduce 6/8"): handed back, not done."""
    written = _squeeze(_clean_math(written))
    return len(written) > 1 and bool(re.search(r"[-+*/^\\]", written)) and written in _squeeze(_clean_math(prompt))


def matches(completion: str, reference: str, form: str = "auto", prompt: str = "") -> bool:
    """Whether the completion's final answer (:func:`final_answer`) is the reference: equal numbers for a numeric
    reference (:func:`numbers_equal`), math-verify equivalence for a symbolic one."""
    reference = str(reference).strip()
    form = resolve_form(reference, form)
    expected = parse_number(reference) if form == "number" else None
    if form == "number" and expected is None:
        raise ValueError(f"answer form 'number' needs a numeric reference answer, got {reference!r}")
    answer = final_answer(completion, form, prompt)
    if answer is None:
        return False
    if form == "number":
        return numbers_equal(answer, expected)
    return _squeeze(answer.text) == _squeeze(reference) or expressions_equal(answer.text, reference)


def vote_key(completion: str, form: str = "auto") -> str | None:
    """The completion's final answer in ``form`` as a canonical string for majority voting (a number's exact
    value, an expression's text; ``auto``: a number, else an expression), None when it states none."""
    answer = None if form == "expression" else final_answer(completion, "number")
    if answer is None and form != "number":
        answer = final_answer(completion, "expression")
    return answer.key if answer else None
