"""Built-in tasks: prompt generators with exact answers and a fixed held-out eval split.

A task yields :class:`Prompt` records: the text given to the model and the metadata a reward function
checks against (``metadata["answer"]`` is the reference answer). Nothing is downloaded.

- ``arithmetic``: ``a+b=`` (the embedded default; reward ``math``).
- ``countdown``: TinyZero's Countdown: reach a target from 3-4 numbers, each used exactly once (reward
  ``countdown``, defined here).
- ``multi``: two-operation arithmetic meant to be judged by several rewards at once (``math`` + ``format`` +
  ``length``, combined by GDPO).

Every task has ``train_batch(step, n, round_)`` (a pure function of seed, step and round, so resume is exact) and
``eval_set(n)`` (a fixed held-out split that training never draws from), and names its ``verifier``: the reward
function that decides whether a completion is correct for accuracy metrics (``math``; ``countdown`` for
countdown, where stating the target number is not a solution). :func:`make_task_from_config` builds the
configured one from ``data.*``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import operator
import random
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar, Literal, get_args

from rewards.answers import final_number, final_text, vote_key
from rewards.functions import RewardFn, load_reward_function, register_reward


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task. ``uid`` is unique within the run's prompt stream (step, index)."""

    uid: str
    text: str
    metadata: dict = field(default_factory=dict)


PromptStyle = Literal["text", "compact"]
"""``text``: instructions in words, for real models; ``compact``: the embedded model's character vocabulary."""
_PROMPT_STYLES = get_args(PromptStyle)


def _check_style(task: str, style: str) -> None:
    if style not in _PROMPT_STYLES:
        raise ValueError(f"task {task!r}: prompt_style must be one of {_PROMPT_STYLES}, got {style!r}")


class Task:
    """What every task shares: ``verifier`` names the reward function (a registered name or ``pkg.module:fn``)
    that decides whether a completion is correct for accuracy metrics, through
    :func:`rewards.functions.is_correct`; :attr:`verifier_fn` is that function, loaded once."""

    verifier: str
    seed: int
    answer_form: str = "number"
    """The form of the task's reference answers (:mod:`rewards.answers`): the built-in tasks' are numbers."""
    step_separator: str = "\n"
    """The text that ends a step of a solution (process rewards, PRMs, step-level search)."""

    @functools.cached_property
    def verifier_fn(self) -> RewardFn:
        return load_reward_function(self.verifier)

    def answer_key(self, completion: str) -> str | None:
        """The completion's final answer as a canonical string, for voting (self-consistency): equal answers
        share a key; None when it states none. The final-answer rule of :mod:`rewards.answers`."""
        return vote_key(completion, self.answer_form)

    def train_batch(self, step: int, n: int, round_: int = 0) -> list[Prompt]:
        """The ``n`` training prompts of ``step`` (extra sampling rounds draw fresh ones), uids
        ``s<step>[r<round>]-<i>``: a pure function of (seed, step, round), so resume is exact."""
        rng = random.Random(f"{self.seed}:{step}" + (f":{round_}" if round_ else ""))
        tag = f"s{step}" + (f"r{round_}" if round_ else "")
        return [Prompt(f"{tag}-{i}", text, meta) for i, (text, meta) in enumerate(self.draw_train(rng, n))]

    def draw_train(self, rng: random.Random, n: int) -> list[tuple[str, dict]]:
        """``n`` training (prompt text, metadata) pairs drawn with ``rng``."""
        raise NotImplementedError


class ArithmeticTask(Task):
    """Addition of two operands in [0, max_operand]; the answer is the decimal sum.

    The eval split is every pair with ``(a * 7 + b * 13) % 10 == 0`` (a fixed ~10% of all pairs); training
    prompts never come from it. ``prompt_style="compact"`` (the default) writes ``a+b=`` in plain digits so the
    embedded character-level model can read it; ``"text"`` asks the question in words, for chat models.
    """

    config_fields: ClassVar[dict[str, str]] = {"max_operand": "max_operand", "seed": "seed",
                                               "prompt_style": "prompt_style"}
    """Constructor keyword -> `data.*` field it comes from."""
    verifier: ClassVar[str] = "math"
    default_style: ClassVar[str] = "compact"

    def __init__(self, max_operand: int = 99, seed: int = 0, prompt_style: PromptStyle = "compact"):
        _check_style("arithmetic", prompt_style)
        self.max_operand = max_operand
        self.seed = seed
        self.prompt_style = prompt_style

    @staticmethod
    def is_eval_pair(a: int, b: int) -> bool:
        return (a * 7 + b * 13) % 10 == 0

    def make(self, uid: str, a: int, b: int) -> Prompt:
        text = f"{a}+{b}=" if self.prompt_style == "compact" else f"What is {a} + {b}?"
        return Prompt(uid=uid, text=text, metadata={"answer": str(a + b), "operands": [a, b]})

    def _draw_pair(self, rng: random.Random) -> tuple[int, int]:
        while True:
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            if not self.is_eval_pair(a, b):
                return a, b

    def draw_train(self, rng: random.Random, n: int) -> list[tuple[str, dict]]:
        out = [self.make("", *self._draw_pair(rng)) for _ in range(n)]
        return [(p.text, p.metadata) for p in out]

    def eval_set(self, n: int) -> list[Prompt]:
        """A fixed held-out set of ``n`` prompts (independent of the run seed)."""
        rng = random.Random("eval")
        pairs = [(a, b) for a in range(self.max_operand + 1) for b in range(self.max_operand + 1)
                 if self.is_eval_pair(a, b)]
        rng.shuffle(pairs)
        return [self.make(f"eval-{i}", a, b) for i, (a, b) in enumerate(pairs[:n])]

    def sft_examples(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        """(prompt, completion) pairs for the supervised warm start, drawn from the training split."""
        out = []
        for _ in range(n):
            a, b = self._draw_pair(rng)
            out.append((f"{a}+{b}=", str(a + b)))
        return out


class GeneratedTask(Task):

    """Base of the generated tasks: a problem is drawn from a seeded RNG, and whether it belongs to the eval
    split is a stable hash of its key (CRC32, the same on every machine), so the splits never overlap and the
    eval split does not depend on the run seed. Subclasses define :meth:`draw`."""

    name: ClassVar[str]
    verifier: ClassVar[str]
    default_style: ClassVar[str] = "text"
    config_fields: ClassVar[dict[str, str]] = {"max_operand": "max_operand", "seed": "seed"}
    eval_fraction: ClassVar[int] = 10
    """One problem key in this many is held out."""
    max_draws: ClassVar[int] = 10_000
    """Attempts at drawing one problem before the settings are declared too narrow."""
    widen_hint: ClassVar[str] = "data.max_operand"
    """The settings to raise when they leave too few problems."""
    seed: int

    def draw(self, rng: random.Random, held_out: bool) -> tuple[str, str, dict] | None:
        """One problem of the eval (``held_out``) or training split: (key, prompt text, metadata); None when this
        attempt fell outside the split (decide the key first, so rejected attempts stay cheap)."""
        raise NotImplementedError

    def in_split(self, key: str, held_out: bool) -> bool:
        return (zlib.crc32(f"{self.name}:{key}".encode()) % self.eval_fraction == 0) == held_out

    def _draw_from_split(self, rng: random.Random, held_out: bool) -> tuple[str, str, dict]:
        for _ in range(self.max_draws):
            problem = self.draw(rng, held_out)
            if problem is not None:
                return problem
        split = "eval" if held_out else "training"
        raise ValueError(f"task {self.name!r}: no {split} problem in {self.max_draws} draws; the settings leave "
                         f"too few problems to split (raise {self.widen_hint})")

    def draw_train(self, rng: random.Random, n: int) -> list[tuple[str, dict]]:
        return [self._draw_from_split(rng, held_out=False)[1:] for _ in range(n)]

    def eval_set(self, n: int) -> list[Prompt]:
        """Up to ``n`` distinct held-out prompts, fixed for given task settings."""
        rng = random.Random(f"{self.name}-eval")
        seen, out = set(), []
        for _ in range(50 * n):
            if len(out) == n:
                break
            key, text, meta = self._draw_from_split(rng, held_out=True)
            if key not in seen:
                seen.add(key)
                out.append(Prompt(f"eval-{len(out)}", text, meta))
        return out


class CountdownTask(GeneratedTask):
    """Countdown (TinyZero): given 3-4 numbers in [1, max_operand] and a target, write an arithmetic expression
    with ``+ - * /`` and parentheses that uses each number exactly once and equals the target.

    Solvable by construction: the target is the value of a random expression tree over all the numbers (random
    pairings and operators; ``/`` only where it divides exactly), kept when it is an integer in [1, max_target].
    A problem's split is decided by its sorted numbers, so eval number sets never appear in training.

    ``prompt_style="text"``: TinyZero's instruction with ``<think>`` / ``<answer>`` tags. ``"compact"``: ``(n1 n2
    n3) target=`` in the embedded model's character vocabulary (``0-9 + - * ( ) =``, so the generator uses no
    ``/`` there). metadata: ``{"answer": str(target), "numbers": [...], "target": target, "solution": expr}``.
    """

    name = "countdown"
    config_fields = {"max_operand": "max_operand", "seed": "seed", "min_numbers": "countdown_min_numbers",
                     "max_numbers": "countdown_max_numbers", "max_target": "countdown_max_target",
                     "prompt_style": "prompt_style"}
    widen_hint = "data.max_operand or data.countdown_max_target"
    verifier = "countdown"
    expression_tries: ClassVar[int] = 20
    """Random expressions tried over one set of numbers for a target within range."""

    def __init__(self, max_operand: int = 99, seed: int = 0, min_numbers: int = 3, max_numbers: int = 4,
                 max_target: int = 100, prompt_style: PromptStyle = "text"):
        if not 2 <= min_numbers <= max_numbers:
            raise ValueError(f"task 'countdown': need 2 <= min_numbers <= max_numbers, got {min_numbers}, "
                             f"{max_numbers}")
        _check_style(self.name, prompt_style)
        self.max_operand, self.seed, self.max_target = max_operand, seed, max_target
        self.min_numbers, self.max_numbers, self.prompt_style = min_numbers, max_numbers, prompt_style
        self.ops = "+-*/" if prompt_style == "text" else "+-*"

    def draw(self, rng: random.Random, held_out: bool) -> tuple[str, str, dict] | None:
        numbers = [rng.randint(1, self.max_operand) for _ in range(rng.randint(self.min_numbers, self.max_numbers))]
        key = ",".join(map(str, sorted(numbers)))
        if not self.in_split(key, held_out):
            return None
        for _ in range(self.expression_tries):
            target, expr = _random_expression(rng, numbers, self.ops)
            if 1 <= target <= self.max_target:
                meta = {"answer": str(target), "numbers": numbers, "target": target, "solution": expr}
                return key, self.prompt(numbers, target), meta
        return None

    def prompt(self, numbers: list[int], target: int) -> str:
        if self.prompt_style == "compact":
            return f"({' '.join(map(str, numbers))}) {target}="
        return (f"Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
                "arithmetic operations (+, -, *, /) and parentheses, and each number must be used exactly once. "
                "Show your work in <think> </think> tags and return the final equation in <answer> </answer> "
                "tags, for example <answer> (1 + 2) / 3 </answer>.")


def _random_expression(rng: random.Random, numbers: list[int], ops: str) -> tuple[int, str]:
    """Value and text of a random binary expression tree using every number once (``/`` only where exact, so
    every intermediate value is an integer)."""
    items = [(n, str(n)) for n in numbers]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (a, ea), (b, eb) = items[i], items[j]
        op = rng.choice([o for o in ops if o != "/" or (b != 0 and a % b == 0)])
        merged = (_INT_OPS[op](a, b), f"({ea}{op}{eb})")
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [merged]
    value, expr = items[0]
    return value, expr[1:-1] if expr.startswith("(") else expr


_INT_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_EXPRESSION_RUN = re.compile(r"[\d+\-*/()\s]*\d[\d+\-*/()\s]*")
_TRAILING_RESULT = re.compile(r"=\s*-?\d+\s*$")
_MAX_EXPRESSION_CHARS = 200


def countdown_expression(completion: str) -> str | None:
    """The expression a completion answers with, read after any ``</think>`` (an unclosed ``<think>`` answers
    nothing): the ``<answer>...</answer>`` content if any (several tags must hold the same expression), else the
    whole text; a trailing ``= <number>`` is dropped, then the last run of ``0-9 + - * / ( )`` and spaces that
    holds a digit is taken."""
    text = final_text(completion)
    if not text:
        return None
    tags = {re.sub(r"\s+", "", t) for t in _ANSWER_TAG.findall(text)}
    if len(tags) > 1:
        return None
    text = _TRAILING_RESULT.sub("", (_ANSWER_TAG.findall(text)[-1] if tags else text).strip())
    runs = _EXPRESSION_RUN.findall(text)
    return runs[-1].strip() if runs else None


def evaluate_expression(expr: str) -> tuple[Fraction, list[int]] | None:
    """Exact value and the integer literals of an expression made only of non-negative integers, binary
    ``+ - * /`` and parentheses (parsed with ``ast``, never ``eval``); None when it is anything else or divides
    by zero."""
    if len(expr) > _MAX_EXPRESSION_CHARS:
        return None
    used: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"not allowed in a countdown expression: {ast.dump(node)[:40]}")

    try:
        return value(ast.parse(expr, mode="eval").body), used
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


@register_reward("countdown")
def countdown_reward(prompt: str, completion: str, metadata: dict, use_all: bool = True,
                     format_score: float = 0.0) -> float:
    """1.0 when the completion's expression (see :func:`countdown_expression`) uses the numbers of
    ``metadata["numbers"]`` (each exactly once; with ``use_all=False`` each at most once) and equals
    ``metadata["target"]`` (else ``metadata["answer"]``) exactly; ``format_score`` when it is a well-formed
    expression that fails either check (TinyZero gives 0.1); else 0.0."""
    expr = countdown_expression(completion)
    parsed = evaluate_expression(expr) if expr else None
    if parsed is None:
        return 0.0
    value, used = parsed
    given, allowed = Counter(used), Counter(int(n) for n in metadata["numbers"])
    numbers_ok = given == allowed if use_all else not given - allowed
    target = Fraction(str(metadata["target"] if "target" in metadata else metadata["answer"]))
    return 1.0 if numbers_ok and value == target else float(format_score)


class MultiTask(GeneratedTask):
    """Two-operation arithmetic ``a o1 b o2 c`` (``o`` in ``+ - *``, usual precedence; operands in [0,
    max_operand]) for multi-reward training: configure the ``math`` (correct final number), ``format``
    (``<think>...</think> answer``) and ``length`` (overlong penalty) rewards and ``algorithm.name: gdpo``,
    which normalizes each component within its group before combining them.

    ``prompt_style="text"`` asks for the think format in words (for real models; the embedded character model
    cannot write ``<think>``). ``"compact"`` is ``a*b+c=`` in the embedded vocabulary; use ``math`` + ``length``
    with it. The split is decided by the expression text.
    """

    name = "multi"
    config_fields = {"max_operand": "max_operand", "seed": "seed", "prompt_style": "prompt_style"}
    verifier = "math"

    def __init__(self, max_operand: int = 99, seed: int = 0, prompt_style: PromptStyle = "text"):
        _check_style(self.name, prompt_style)
        self.max_operand, self.seed, self.prompt_style = max_operand, seed, prompt_style

    def draw(self, rng: random.Random, held_out: bool) -> tuple[str, str, dict] | None:
        a, b, c = (rng.randint(0, self.max_operand) for _ in range(3))
        expr = f"{a}{rng.choice('+-*')}{b}{rng.choice('+-*')}{c}"
        if not self.in_split(expr, held_out):
            return None
        answer = str(evaluate_expression(expr)[0])
        if self.prompt_style == "compact":
            return expr, f"{expr}=", {"answer": answer}
        text = (f"Compute {expr}. Think step by step inside <think> </think> tags, then write only the final "
                "number after </think>.")
        return expr, text, {"answer": answer}


class MultiplyTask(GeneratedTask):
    """Multiplication of a 3-digit by a 2-digit number: the built-in tool task. Hard to do in one's
    head for a small model, trivial with the calculator tool: ``347*58=`` -> the model writes the call
    ``[347*58]``, the environment appends the observation ``{20126}``, the model answers ``20126``.

    ``prompt_style="compact"``: ``a*b=`` in the embedded tool model's characters; ``"text"``: the question in
    words, for chat models (which call the tool through their chat template). The split is decided by ``a*b``.
    metadata: ``{"answer": str(a * b), "a": a, "b": b}``.
    """

    name = "multiply"
    config_fields = {"seed": "seed", "prompt_style": "prompt_style"}
    widen_hint = "nothing (the ranges are fixed)"
    verifier = "math"
    default_style = "compact"

    def __init__(self, seed: int = 0, prompt_style: PromptStyle = "compact"):
        _check_style(self.name, prompt_style)
        self.seed, self.prompt_style = seed, prompt_style

    def draw(self, rng: random.Random, held_out: bool) -> tuple[str, str, dict] | None:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        key = f"{a}*{b}"
        if not self.in_split(key, held_out):
            return None
        text = f"{key}=" if self.prompt_style == "compact" else (
            f"What is {a} * {b}? Use the calculator tool, then reply with the number only.")
        return key, text, {"answer": str(a * b), "a": a, "b": b}

    def sft_examples(self, rng: random.Random, n: int, tool_fraction: float) -> list[tuple[str, list]]:
        """Warm-start demonstrations in the compact style: ``(prompt, [(text, trainable), ...])``. A
        ``tool_fraction`` of them call the calculator (the observation segment is not trained on); the rest answer
        directly with the true product."""
        out = []
        for _ in range(n):
            _, text, meta = self._draw_from_split(rng, held_out=False)
            call = f"{meta['a']}*{meta['b']}"
            if rng.random() < tool_fraction:
                out.append((text, [(f"[{call}]", True), (f"{{{meta['answer']}}}", False), (meta["answer"], True)]))
            else:
                out.append((text, [(meta["answer"], True)]))
        return out


class ToolChoiceTask(GeneratedTask):
    """Two kinds of problem, two tools: the policy has to choose. Half are multiplications of a
    3-digit by a 2-digit number (``What is 347 * 58?``: the ``calculator``, arguments ``{"expression": ...}``), half
    count a letter in a random string (``How many times does the letter 'c' appear in 'cabdcefa...'?``: the
    ``python`` tool, arguments ``{"code": ...}``; the calculator cannot do it). The prompt does not name the tool.
    Both answers are one integer (verifier ``math``). metadata: ``{"answer", "kind": "multiply" | "count",
    "tool": the tool that solves it, ...}`` (``a``, ``b`` or ``text``, ``letter``); ``env/right_tool_rate`` reads
    ``tool``. The split is decided by the problem's text."""

    name = "tool_choice"
    config_fields = {"seed": "seed", "prompt_style": "prompt_style"}
    widen_hint = "nothing (the ranges are fixed)"
    verifier = "math"
    letters = "abcdef"
    string_length = (12, 16)

    def __init__(self, seed: int = 0, prompt_style: PromptStyle = "text"):
        if prompt_style != "text":
            raise ValueError(f"task 'tool_choice': prompt_style must be 'text' (a chat model's task), got "
                             f"{prompt_style!r}")
        self.seed, self.prompt_style = seed, prompt_style

    def draw(self, rng: random.Random, held_out: bool) -> tuple[str, str, dict] | None:
        if rng.random() < 0.5:
            a, b = rng.randint(100, 999), rng.randint(10, 99)
            key = f"{a}*{b}"
            if not self.in_split(key, held_out):
                return None
            return key, f"What is {a} * {b}? Reply with the number only.", \
                {"answer": str(a * b), "kind": "multiply", "tool": "calculator", "a": a, "b": b}
        text = "".join(rng.choice(self.letters) for _ in range(rng.randint(*self.string_length)))
        letter = rng.choice(self.letters)
        key = f"{letter} in {text}"
        if not self.in_split(key, held_out):
            return None
        return key, f"How many times does the letter '{letter}' appear in '{text}'? Reply with the number only.", \
            {"answer": str(text.count(letter)), "kind": "count", "tool": "python", "text": text, "letter": letter}


class ChainTask(GeneratedTask):
    """Chained addition with its steps written out: the built-in step-structured task (process supervision,
    PRMs, step-level search). ``a+b+c+d=`` is solved as the running totals, one step each, the last one the
    answer: ``12+30+7+21=`` -> ``42;49;70``. Every step is checkable on its own (``metadata["steps"]``), so a
    process reward model's step scores can be compared with the truth, not only with Monte-Carlo labels.

    ``prompt_style="compact"``: the embedded step model's characters, steps separated by ``;``;
    ``"text"``: the question in words, one running total per line (separator ``\n``). ``chain_terms`` numbers
    are drawn from [0, max_operand]; the split is decided by the expression. metadata: ``{"answer",
    "terms", "steps"}`` (steps as strings).
    """

    name = "chain"
    config_fields = {"max_operand": "max_operand", "seed": "seed", "terms": "chain_terms",
                     "prompt_style": "prompt_style"}
    verifier = "chain"
    default_style = "compact"
    separators: ClassVar[dict[str, str]] = {"compact": ";", "text": "\n"}

    def __init__(self, max_operand: int = 99, seed: int = 0, terms: int = 4, prompt_style: PromptStyle = "compact"):
        _check_style(self.name, prompt_style)
        if not 2 <= terms <= 8:
            raise ValueError(f"task 'chain': terms must be in [2, 8], got {terms}")
        self.max_operand, self.seed, self.terms, self.prompt_style = max_operand, seed, terms, prompt_style

    @property
    def step_separator(self) -> str:
        return self.separators[self.prompt_style]

    def draw(self, rng: random.Random, held_out: bool) -> tuple[str, str, dict] | None:
        terms = [rng.randint(0, self.max_operand) for _ in range(self.terms)]
        expr = "+".join(map(str, terms))
        if not self.in_split(expr, held_out):
            return None
        steps = [str(sum(terms[: k + 1])) for k in range(1, len(terms))]
        text = f"{expr}=" if self.prompt_style == "compact" else (
            f"Add {', '.join(map(str, terms[:-1]))} and {terms[-1]} one number at a time: write each running total "
            "on its own line and nothing else; the last line is the answer.")
        return expr, text, {"answer": steps[-1], "terms": terms, "steps": steps}

    def answer_key(self, completion: str) -> str | None:
        """The last step's number (a chain solution's answer)."""
        answer = chain_answer(completion)
        return answer.key if answer else None

    def solution(self, metadata: dict) -> str:
        """The reference completion: the steps joined by the separator."""
        return self.step_separator.join(metadata["steps"])

    def sft_examples(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        """(prompt, reference completion) pairs from the training split, for the embedded model's warm start."""
        out = []
        for _ in range(n):
            _, text, meta = self._draw_from_split(rng, held_out=False)
            out.append((text, self.solution(meta)))
        return out


_LAST_INT = re.compile(r"-?\d+")
_STEP_SPLIT = re.compile(r"[;\n]")


@register_reward("chain")
def chain_reward(prompt: str, completion: str, metadata: dict) -> float:
    """1.0 when the completion's last step states one number (:func:`rewards.answers.final_number`: ``70`` or
    ``49+21=70``) and it is ``metadata["answer"]``, and the completion has no more steps (segments holding a
    digit, split at ``;`` or a newline) than the solution (``metadata["steps"]``); else 0.0. A spammed count
    (``0;1;2;...``) has too many steps; reasoning in ``<think>`` is not the answer."""
    answer = chain_answer(completion, len(metadata.get("steps", ())) or None)
    return float(answer is not None and answer.value == int(metadata["answer"]))


def chain_answer(completion: str, max_steps: int | None = None):
    """The number a chain solution ends with (its last step), or None (see :func:`chain_reward`)."""
    text = final_text(completion)
    steps = [s for s in _STEP_SPLIT.split(text or "") if re.search(r"[0-9]", s)]
    if not steps or (max_steps is not None and len(steps) > max_steps):
        return None
    return final_number(steps[-1])


def step_truth(steps: list[str], metadata: dict) -> list[bool]:
    """Whether each written step of a ``chain`` solution is the true running total at that point (a step that
    is not exactly one number is wrong; steps past the last true one are wrong)."""
    truth = metadata["steps"]
    out = []
    for k, step in enumerate(steps):
        numbers = _LAST_INT.findall(step)
        out.append(k < len(truth) and len(numbers) == 1 and int(numbers[0]) == int(truth[k]))
    return out


TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "multi": MultiTask, "multiply": MultiplyTask,
         "chain": ChainTask, "tool_choice": ToolChoiceTask}


LAZY_TASKS = {"constitution": "rewards.constitution:ConstitutionTask"}
"""Tasks defined in modules that build on this one (imported on first use)."""


def task_class(name: str) -> type:
    if name in LAZY_TASKS:
        module, attr = LAZY_TASKS[name].split(":")
        return getattr(importlib.import_module(module), attr)
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; valid: {sorted([*TASKS, *LAZY_TASKS])}")
    return TASKS[name]


def make_task(name: str, **kwargs) -> ArithmeticTask | GeneratedTask:
    return task_class(name)(**kwargs)


def make_task_from_config(data) -> ArithmeticTask | GeneratedTask:
    """The task ``data.task`` names, with the ``data.*`` fields it declares in ``config_fields``
    (``prompt_style: auto`` is the task's ``default_style``)."""
    cls = task_class(data.task)
    kwargs = {kw: getattr(data, attr) for kw, attr in cls.config_fields.items()}
    if kwargs.get("prompt_style") == "auto":
        kwargs["prompt_style"] = cls.default_style
    return cls(**kwargs)
