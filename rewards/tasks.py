"""Built-in tasks: prompt generators with exact answers and a fixed held-out eval split.

A task yields :class:`Prompt` records: the text given to the model and the metadata a reward function
checks against (``metadata["answer"]`` is the reference answer). Nothing is downloaded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task. ``uid`` is unique within the run's prompt stream (step, index)."""

    uid: str
    text: str
    metadata: dict = field(default_factory=dict)


class ArithmeticTask:
    """Addition ``a+b=`` with operands in [0, max_operand]; the answer is the decimal sum.

    The eval split is every pair with ``(a * 7 + b * 13) % 10 == 0`` (a fixed ~10% of all pairs); training
    prompts never come from it. Prompts and answers are plain digits so the embedded character-level model
    can read them.
    """

    def __init__(self, max_operand: int = 99, seed: int = 0):
        self.max_operand = max_operand
        self.seed = seed

    @staticmethod
    def is_eval_pair(a: int, b: int) -> bool:
        return (a * 7 + b * 13) % 10 == 0

    @staticmethod
    def make(uid: str, a: int, b: int) -> Prompt:
        return Prompt(uid=uid, text=f"{a}+{b}=", metadata={"answer": str(a + b)})

    def _draw_pair(self, rng: random.Random) -> tuple[int, int]:
        while True:
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            if not self.is_eval_pair(a, b):
                return a, b

    def train_batch(self, step: int, n: int, round_: int = 0) -> list[Prompt]:
        """The ``n`` training prompts of ``step`` (extra sampling rounds draw fresh ones); a pure function of
        (seed, step, round), so resume is exact."""
        rng = random.Random(f"{self.seed}:{step}" + (f":{round_}" if round_ else ""))
        tag = f"s{step}" + (f"r{round_}" if round_ else "")
        return [self.make(f"{tag}-{i}", *self._draw_pair(rng)) for i in range(n)]

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


TASKS = {"arithmetic": ArithmeticTask}


def make_task(name: str, **kwargs) -> ArithmeticTask:
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; valid: {sorted(TASKS)}")
    return TASKS[name](**kwargs)
