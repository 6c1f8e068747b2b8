"""The mismatch doctor: does the learner score the engines' samples as the engines sampled them? Run by the driver
before step 0 (when ``rollout.max_logprob_gap`` is set) and by ``fleetrl doctor -c CONFIG [overrides]``.

It pushes the learner's weights into the engines, samples a small batch as a step does (the run's temperature and
top-p), has the learner score the same tokens, and reports ``|learner - engine|`` logprob over them (max, p99,
mean: :func:`learner.corrections.logprob_gap_stats`). Then it tests each cause in turn:

- ``push``: the float64 checksums (sum, sum of |x|) of every tensor the engines received in that push against
  the learner's own (a corrupted push: transport or engine load);
- ``temperature``: the learner's scoring temperature against the sampling one (measured: the learner rescoring
  the batch at the sampling temperature);
- ``top_p``: the engines' logprobs are renormalized over the top-p nucleus (vLLM's processed logprobs), the
  learner's are over the whole vocabulary;
- ``tokenization``: a decode -> encode round trip of the sampled completions (chat-template or re-tokenization
  drift; the run trains on the engines' token ids, so it matters where text is re-tokenized);
- ``dtype``: the engines' dtype against the learner's (rounding; a statement, not a second fleet in fp32).

A p99 gap above ``rollout.max_logprob_gap`` refuses the run (:class:`MismatchRefused`), naming the first failed
test as the cause (else the dtype, else the tokenization) and its fix.
"""

from __future__ import annotations

import dataclasses

import ray

from learner.corrections import logprob_gap_stats
from orchestrator.rl.collect import samples_to_batch
from orchestrator.rl.specs import FAULT_LEARNER_TEMPERATURE, learner_temperature

PROMPTS, SAMPLES, SEED = 4, 2, 31_337  # the doctor's batch: 4 training prompts x 2 samples


class MismatchRefused(RuntimeError):
    """The engines' and the learner's logprobs differ by more than ``rollout.max_logprob_gap``: the run is refused."""


@dataclasses.dataclass
class Finding:
    test: str
    ok: bool
    detail: str
    fix: str


@dataclasses.dataclass
class Diagnosis:
    gap: dict[str, float]  # max, p99, mean |learner - engine| logprob (nats) at the learner's temperature
    tokens: int
    samples: int
    limit: float | None  # rollout.max_logprob_gap (on the p99)
    findings: list[Finding]

    @property
    def healthy(self) -> bool:
        """The gap within the limit, and the engines hold what the learner pushed: a push that arrived changed
        is refused whatever the gap (a corrupted tensor may move few of the sampled tokens' logprobs)."""
        push = next((f for f in self.findings if f.test == "push"), None)
        return (push is None or push.ok) and (self.limit is None or self.gap["p99"] <= self.limit)

    @property
    def cause(self) -> Finding | None:
        """The first failed test; a dtype or tokenization difference only when no other test failed."""
        order = [f for f in self.findings if f.test not in ("dtype", "tokenization")] + \
            [f for f in self.findings if f.test == "dtype"] + [f for f in self.findings if f.test == "tokenization"]
        return next((f for f in order if not f.ok), None)

    def lines(self) -> list[str]:
        g = self.gap
        out = [f"doctor: |learner - engine| logprob of {self.tokens} tokens ({self.samples} samples): "
               f"max {g['max']:.4g}  p99 {g['p99']:.4g}  mean {g['mean']:.4g}  (limit: p99 <= {self.limit})"]
        out += [f"  {f.test:<13}{'ok' if f.ok else 'FAIL':<6}{f.detail}" for f in self.findings]
        cause = self.cause
        if self.healthy:
            out.append("verdict: healthy" + (f" (note: {cause.test} differs)" if cause else ""))
        else:
            named = f"cause: {cause.test}: {cause.detail}. fix: {cause.fix}" if cause else \
                "cause: none of the tests failed (unknown). fix: report it with this table"
            over = f"p99 gap {g['p99']:.4g} > rollout.max_logprob_gap={self.limit}" \
                if self.limit is not None and g["p99"] > self.limit else f"p99 gap {g['p99']:.4g}, a changed push"
            out.append(f"verdict: REFUSED: {over}; {named}")
        return out

    def summary(self) -> str:
        """One console line for a healthy run (the table goes to the driver log)."""
        differs = [f.test for f in self.findings if not f.ok]
        return (f"doctor: healthy: |learner - engine| logprob p99 {self.gap['p99']:.3g} (max {self.gap['max']:.3g}) "
                f"over {self.tokens} tokens" + (f"; differs: {', '.join(differs)}" if differs else "; every check ok"))


def diagnose(run) -> Diagnosis:
    """The doctor on ``run``'s started fleet (learner, engines and their weight sync; see the module)."""

    cfg, fleet = run.cfg, run.fleet
    fleet.weight_sync.push(run.version)  # the engines record checksums of what they receive
    samples = fleet.rollouts.generate(run.task.train_batch(0, PROMPTS), SAMPLES, cfg.rollout.temperature, SEED)
    world = fleet.learner.world
    samples = [samples[i % len(samples)] for i in range(-(-len(samples) // world) * world)]
    batch = samples_to_batch(samples, run.pad_id)
    scored = fleet.learner.compute_logprobs(dataclasses.replace(batch))
    gap = logprob_gap_stats(scored.old_logprobs, batch.rollout_logprobs, batch.response_mask)
    findings = [_push(fleet), _temperature(cfg, fleet, batch, gap), _top_p(cfg, scored),
                _tokenization(run.tokenizer, samples), _dtype(cfg)]
    return Diagnosis(gap, int(batch.response_mask.sum()), len(samples), cfg.rollout.max_logprob_gap, findings)


def _push(fleet) -> Finding:
    learner = fleet.learner.weight_checksums()
    engines = ray.get([w.push_checksums.remote() for w in fleet.rollouts.workers])
    fix = ("the engines did not get the learner's tensors intact: check the push path (rollout.weight_sync; "
           "object_store is the reference) and the engines' weight loader for this model")
    if not all(engines):
        return Finding("push", True, "n/a: the push carries no base-model tensors (LoRA adapter push)", fix)
    bad = [(i, name) for i, got in enumerate(engines) for name, (s, a) in learner.items()
           if name not in got or abs(got[name][0] - s) > 1e-9 * a + 1e-12 or abs(got[name][1] - a) > 1e-9 * a + 1e-12]
    if not bad:
        return Finding("push", True, f"{len(learner)} tensors: every engine's checksums equal the learner's", fix)
    i, name = bad[0]
    got = engines[i].get(name, (float("nan"),) * 2)
    return Finding("push", False, f"{len(bad)} tensor(s) differ, e.g. {name} on rollout-{i}: engine sum "
                   f"{got[0]:.6g} vs learner {learner[name][0]:.6g}", fix)


def _temperature(cfg, fleet, batch, gap: dict) -> Finding:
    t_learner, t_sample = learner_temperature(cfg), cfg.rollout.temperature
    fix = (f"the learner must score at the sampling temperature (rollout.temperature={t_sample}); unset "
           f"{FAULT_LEARNER_TEMPERATURE}, or give a custom loss the sampling temperature")
    if t_learner == t_sample:
        return Finding("temperature", True, f"learner and engines at T={t_sample}", fix)
    at_sample = fleet.learner.compute_logprobs(dataclasses.replace(batch), temperature=t_sample)
    fixed = logprob_gap_stats(at_sample.old_logprobs, batch.rollout_logprobs, batch.response_mask)
    return Finding("temperature", False, f"learner scores at T={t_learner}, engines sample at T={t_sample}; "
                   f"rescored at T={t_sample}: p99 {fixed['p99']:.4g} (was {gap['p99']:.4g})", fix)


def _top_p(cfg, scored) -> Finding:
    top_p, m = cfg.rollout.top_p, scored.response_mask > 0
    fix = "rollout.top_p=1 (the learner cannot see the nucleus), or accept it: algorithm.tis_cap weighs it"
    if top_p >= 1.0:
        return Finding("top_p", True, "1.0: the engines' logprobs are over the whole vocabulary", fix)
    excess = float((scored.rollout_logprobs - scored.old_logprobs)[m].mean()) if m.any() else 0.0
    return Finding("top_p", False, f"{top_p}: the engines renormalize over the nucleus (engine - learner "
                   f"logprob: mean {excess:+.4g})", fix)


def _tokenization(tokenizer, samples: list) -> Finding:
    drift = sum(tokenizer.encode(tokenizer.decode(s.completion_ids), add_special_tokens=False) != s.completion_ids
                for s in samples)
    return Finding("tokenization", drift == 0, f"{drift}/{len(samples)} completions change in a decode -> encode "
                   "round trip (the run trains on the engines' token ids)",
                   "keep the engines' token ids where text is re-tokenized (multi-turn environments, agents), or "
                   "fix the chat template (data.chat_template)")


def _dtype(cfg) -> Finding:
    engines = cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
    learner = cfg.model.dtype + (f" (autocast {cfg.learner.mixed_precision})" if cfg.learner.mixed_precision else "")
    same = engines == cfg.model.dtype and cfg.learner.mixed_precision in (None, engines)
    return Finding("dtype", same, f"engines {engines}, learner {learner}",
                   "rollout.dtype=float32 with model.dtype=float32 (no rounding gap), or raise "
                   "rollout.max_logprob_gap: algorithm.tis_cap corrects rounding")


def check_run(run) -> None:
    """Before step 0: the doctor's table in the driver log and console; a gap above the limit refuses the run."""
    import logging

    d = diagnose(run)
    for line in d.lines():
        logging.getLogger("fleetrl").info(line)
    if d.healthy:
        run.console.print(d.summary())
        return
    for line in d.lines():
        run.console.print(line)
    raise MismatchRefused("\n".join(d.lines()))
