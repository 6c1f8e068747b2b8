"""The ``judge`` reward (``reward.functions: [{name: judge, weight, params: {on_error}}]``): an AI feedback model
scores each response against the constitution (Constitutional AI's RL stage with a judge instead of a preference
model).

For every sample, each principle that applies to its prompt (:func:`applicable`) is asked as a yes/no rubric
question (:func:`rewards.constitution.rubric_question`); the judge's P(yes) is read from its next-token
probabilities of the option letters, normalized over the options, asked with the options in both orders when
``cai.both_orders`` (the mean cancels a preference for a position). The sample's ``judge`` component is the mean
P(yes) over its principles. Every question of the step goes to the judge's engines in one batched call (the
policy's own rollout engines for ``cai.judge: policy``, the ``judge-i`` engines of ``cai.feedback_model`` for
``cai.judge: model``).

A question the judge cannot answer (an engine error, a conversation longer than the judge's context, a
non-finite probability) is counted in ``reward/judge_errors`` and the sample scores ``on_error`` (default 0):
never a crash. :class:`Judge` is plain logic over an ``engines`` object with ``option_logprobs``, so its
batching and error counting are tested without actors.
"""

from __future__ import annotations

import logging
import math

from rewards.constitution import (
    ANSWER_PREFIX,
    Constitution,
    Principle,
    option_probabilities,
    rubric_question,
)

log = logging.getLogger("fleetrl")

NAME = "judge"
"""The reward-function name that selects the judge (not a registered pure function: it needs engines)."""
PARAMS = ("on_error",)
"""The judge's ``params`` keys (``on_error``: a finite number)."""


def applicable(constitution: Constitution, metadata: dict) -> list[Principle]:
    """The principles that apply to a prompt: those whose rule the prompt lists in ``metadata["checks"]``, and
    those without a rule; all of them when the prompt lists no checks."""
    checks = metadata.get("checks")
    if not checks:
        return list(constitution.principles)
    return [p for p in constitution.principles if p.rule is None or p.rule in checks] or \
        list(constitution.principles)


def as_messages(prompt) -> list[dict]:
    """A task prompt (text or chat messages) as chat messages."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


class Judge:
    """Scores responses with the rubric questions of ``constitution``'s principles (see the module)."""

    def __init__(self, constitution: Constitution, option_ids: list[int], both_orders: bool = True,
                 on_error: float = 0.0, strict: bool = False):
        """``strict`` (``reward.strict``): a failing judge call raises instead of scoring ``on_error``."""
        self.constitution, self.option_ids = constitution, option_ids
        self.orders = (True, False) if both_orders else (True,)
        self.on_error, self.strict = on_error, strict

    def questions(self, items: list[tuple[list[dict], str, dict]]) -> tuple[list[list[dict]], list[int]]:
        """Every rubric question of every (conversation, response, metadata), in every order, and the index of the
        item each belongs to."""
        out, owner = [], []
        for i, (conv, response, meta) in enumerate(items):
            for principle in applicable(self.constitution, meta):
                for yes_first in self.orders:
                    out.append(rubric_question(conv, response, principle, self.constitution.options, yes_first))
                    owner.append(i)
        return out, owner

    def score(self, engines, items: list[tuple[list[dict], str, dict]]) -> tuple[list[float], int]:
        """``(scores, errors)``: each item's mean P(yes) over its principles (``on_error`` when any of its
        questions failed) and how many items failed (responses, not questions); one batched
        ``engines.option_logprobs`` call."""
        questions, owner = self.questions(items)
        try:
            readings = engines.option_logprobs(questions, ANSWER_PREFIX, self.option_ids)
        except Exception as e:  # noqa: BLE001 - a judge failure is scored, never fatal (unless strict)
            if self.strict:
                raise
            log.warning("judge: %d questions failed (%s: %s); scored %s", len(questions), type(e).__name__, e,
                        self.on_error)
            readings = [None] * len(questions)
        yes: list[list[float]] = [[] for _ in items]
        failed = [False] * len(items)
        for q, (i, lp) in enumerate(zip(owner, readings)):
            if lp is None or not all(math.isfinite(v) for v in lp):
                failed[i] = True
                continue
            p = option_probabilities(lp)
            yes[i].append(p[0] if self.orders[q % len(self.orders)] else p[1])
        scores = [self.on_error if bad or not ys else sum(ys) / len(ys) for bad, ys in zip(failed, yes)]
        return scores, sum(failed)
