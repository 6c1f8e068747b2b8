"""Constitutional AI (Bai et al. 2022) from the rollout engines: ``fleetrl cai revise`` (SL-CAI data) and
``fleetrl cai prefer`` (RL-CAI preference pairs). The principles and the judge's question are in
:mod:`rewards.constitution`; settings in the ``cai`` config section.

- **revise**: for each training prompt of the task the policy answers; then, ``cai.revisions`` times, it is asked
  to critique its answer against a principle drawn at random among those that apply to the prompt, and to revise
  it. Every turn of every conversation is one batched ``generate`` over the rollout engines (chat messages
  rendered by the model's template). Rows ``{"messages": [prompt..., assistant: final revision], "principles",
  "revisions", "critiques"}`` are what ``fleetrl sft`` (or an ``sft`` stage) trains on.
- **prefer**: for each prompt two responses are sampled; a drawn principle's preference question is put to the
  judge (the policy, a feedback model on engines of its own, or the principle's rule), and P(first is better) is
  read from the judge's next-token probabilities of the option letters, normalized, averaged over both orders.
  Rows ``{"prompt", "chosen", "rejected", "preference", "principle"}`` are what DPO trains on (``preference`` is
  the soft label, P(chosen is better) >= 0.5).

Both print a summary: the rule-checked satisfaction of the answers before and after revision; the AI labels'
agreement with the rule where the rule tells the two responses apart.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from pathlib import Path

from orchestrator.config import ConfigError, FleetConfig
from orchestrator.rl.judge import check_judge
from rewards.constitution import (
    ANSWER_PREFIX,
    ConstitutionError,
    Principle,
    load_constitution,
    option_probabilities,
    preference_from_orders,
    preference_question,
)
from rewards.functions import load_reward_function, verdicts
from rewards.judge import applicable, as_messages
from rewards.tasks import Prompt

log = logging.getLogger("fleetrl")


def rule_satisfied(principle: Principle, messages: list[dict], response: str, metadata: dict) -> bool | None:
    """The principle's rule on a response (None without a rule)."""
    if not principle.rule:
        return None
    return load_reward_function(principle.rule)(messages[-1]["content"], response, metadata) >= 1.0


def satisfaction(task, prompts: list[Prompt], responses: list[str]) -> float:
    """Share of responses that pass every rule check of their prompt (the task's verifier)."""
    ok = verdicts(task.verifier_fn, [("", r, p.metadata) for p, r in zip(prompts, responses)])
    return sum(ok) / max(len(ok), 1)


class CAIRun:
    """The task's prompts, the constitution and the engines of one ``fleetrl cai`` command, used as a context
    manager (``with CAIRun(...) as run``: engines the command started are stopped on exit). Everything that can be
    checked (the principles file, the judge model and its option tokens) is checked before any actor starts."""

    def __init__(self, cfg: FleetConfig, n: int, judging: bool = False, fleet=None):
        """``fleet``: a fleet of this process to serve the command (a pipeline's): its learner loads ``model.path``
        and pushes it into the engines it keeps, and it is left running; without one the command starts engines of
        its own (:meth:`Fleet.for_command`)."""
        from orchestrator.rl.fleet import Fleet, Roles
        from orchestrator.rl.launch import load_tokenizer, make_task
        from workers.prompts import pad_token_id

        try:
            self.constitution = load_constitution(cfg.cai.principles)
        except ConstitutionError as e:
            raise ConfigError(f"cai.principles: {e}") from None
        self.cfg, self.task = cfg, make_task(cfg)
        self.option_ids = check_judge(cfg, self.constitution) if judging and cfg.cai.judge != "rule" else None
        self.prompts = [Prompt(f"cai-{i}", text, meta) for i, (text, meta) in
                        enumerate(self.task.draw_train(random.Random(f"cai:{cfg.data.seed}"), n))]
        self.rng = random.Random(f"cai-principles:{cfg.data.seed}")
        self.calls = 0
        roles = Roles(learner=fleet is not None, rollout=True, feedback=judging and cfg.cai.judge == "model")
        probe = (self.task.train_batch(0, 1), pad_token_id(load_tokenizer(cfg.model.path))) if fleet else None
        self._serving = contextlib.ExitStack()
        self.fleet = self._serving.enter_context(Fleet.for_command(fleet, cfg, roles, probe=probe))
        self.rollouts, self.judge = self.fleet.rollouts, self.fleet.feedback

    def __enter__(self) -> CAIRun:
        return self

    def __exit__(self, *exc) -> None:
        self._serving.__exit__(*exc)  # Fleet.for_command's exit: the command's own fleet stopped

    def reply(self, conversations: list[list[dict]], temperature: float, group_size: int = 1) -> list[str]:
        """One assistant turn per conversation (``group_size`` of them, grouped), batched over the engines."""
        self.calls += 1  # each turn its own seeds: a critique and the revision after it are not drawn alike
        prompts = [Prompt(f"c{i}", conv, {}) for i, conv in enumerate(conversations)]
        samples = self.rollouts.generate(prompts, group_size, temperature, seed=self.cfg.rollout.seed + self.calls)
        return [s.completion_text.strip() for s in samples]


def revise(cfg: FleetConfig, n: int, out: str | Path, fleet=None) -> dict:
    """SL-CAI data: ``n`` prompts answered, critiqued and revised ``cai.revisions`` times (see the module), on
    ``fleet`` when given (:class:`CAIRun`)."""
    t0 = time.perf_counter()
    with CAIRun(cfg, n, fleet=fleet) as run:
        convs = [as_messages(p.text) for p in run.prompts]
        answers = run.reply(convs, cfg.rollout.temperature)
        first = list(answers)
        history = [{"principles": [], "revisions": [a], "critiques": []} for a in answers]
        for _ in range(cfg.cai.revisions):
            drawn = [run.rng.choice(applicable(run.constitution, p.metadata)) for p in run.prompts]
            asked = [c + [{"role": "assistant", "content": a}, {"role": "user", "content": pr.critique}]
                     for c, a, pr in zip(convs, answers, drawn)]
            critiques = run.reply(asked, cfg.rollout.temperature)
            answers = run.reply([c + [{"role": "assistant", "content": k}, {"role": "user", "content": pr.revision}]
                                 for c, k, pr in zip(asked, critiques, drawn)], cfg.rollout.temperature)
            for h, pr, k, a in zip(history, drawn, critiques, answers):
                h["principles"].append(pr.name)
                h["critiques"].append(k)
                h["revisions"].append(a)
    rows = [{"messages": [*c, {"role": "assistant", "content": a}], **h}
            for c, a, h in zip(convs, answers, history) if a]  # an empty revision teaches nothing
    _write_jsonl(out, rows)
    summary = {"rows": len(rows), "empty": len(answers) - len(rows), "out": str(out), "revisions": cfg.cai.revisions,
               "satisfaction_before": satisfaction(run.task, run.prompts, first),
               "satisfaction_after": satisfaction(run.task, run.prompts, answers),
               "seconds": round(time.perf_counter() - t0, 1)}
    log.info("cai revise: %s", summary)
    return summary


def prefer(cfg: FleetConfig, n: int, out: str | Path, fleet=None) -> dict:
    """RL-CAI preference pairs for ``n`` prompts (see the module), on ``fleet`` when given."""
    t0 = time.perf_counter()
    with CAIRun(cfg, n, judging=True, fleet=fleet) as run:
        convs = [as_messages(p.text) for p in run.prompts]
        responses = run.reply(convs, cfg.rollout.temperature, group_size=2)
        pairs = [(responses[2 * i], responses[2 * i + 1]) for i in range(len(convs))]
        drawn = [run.rng.choice(applicable(run.constitution, p.metadata)) for p in run.prompts]
        probs = judge_pairs(run, convs, pairs, drawn)
    rows, agree = [], []
    for p, conv, (a, b), pr, prob in zip(run.prompts, convs, pairs, drawn, probs):
        if a == b:
            continue  # nothing to prefer
        chosen, rejected, pref = (a, b, prob) if prob >= 0.5 else (b, a, 1.0 - prob)
        rows.append({"prompt": conv, "chosen": chosen, "rejected": rejected, "preference": round(pref, 6),
                     "principle": pr.name})
        truth = (rule_satisfied(pr, conv, chosen, p.metadata), rule_satisfied(pr, conv, rejected, p.metadata))
        if None not in truth and truth[0] != truth[1]:
            agree.append(truth[0])
    _write_jsonl(out, rows)
    k = len(agree)
    rate = sum(agree) / k if k else None
    summary = {"rows": len(rows), "out": str(out), "judge": cfg.cai.judge,
               "rule_decided_pairs": k, "agreement_with_rule": rate,
               "agreement_se": math.sqrt(rate * (1 - rate) / k) if k else None,
               "mean_preference": sum(r["preference"] for r in rows) / max(len(rows), 1),
               "seconds": round(time.perf_counter() - t0, 1)}
    log.info("cai prefer: %s", summary)
    return summary


def judge_pairs(run: CAIRun, convs: list[list[dict]], pairs: list[tuple[str, str]],
                drawn: list[Principle]) -> list[float]:
    """P(first response is better) of each pair under its drawn principle, by ``cai.judge``."""
    if run.cfg.cai.judge == "rule":
        out = []
        for p, conv, (a, b), pr in zip(run.prompts, convs, pairs, drawn):
            sa, sb = rule_satisfied(pr, conv, a, p.metadata), rule_satisfied(pr, conv, b, p.metadata)
            out.append(0.5 if sa is None or sa == sb else float(sa))
        return out
    engines, options = run.judge or run.rollouts, run.constitution.options
    orders = [(0, 1), (1, 0)] if run.cfg.cai.both_orders else [(0, 1)]
    readings = []
    for order in orders:
        questions = [preference_question(conv, [pair[order[0]], pair[order[1]]], pr, options)
                     for conv, pair, pr in zip(convs, pairs, drawn)]
        answered = engines.option_logprobs(questions, ANSWER_PREFIX, run.option_ids)
        # a question too long for the judge's context has no reading: no preference either way
        readings.append([option_probabilities(lp) if lp else [0.5, 0.5] for lp in answered])
    return [preference_from_orders(*(r[i] for r in readings)) for i in range(len(pairs))]


def _write_jsonl(out: str | Path, rows: list[dict]) -> None:
    from orchestrator.data import write_jsonl

    write_jsonl(out, rows)
