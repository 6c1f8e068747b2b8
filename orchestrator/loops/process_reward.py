"""Process reward models from the policy's own samples: Math-Shepherd labels, then PRM training.

`fleetrl prm label -c CONFIG --out FILE`: the rollout engines sample ``prm.samples`` solutions for each of
``prm.prompts`` training prompts; every solution is cut into steps at the step separator (at the tokens the
engine sampled); from every step prefix but the last, ``prm.continuations`` completions are sampled (one batched
engine call; vLLM's prefix cache shares the prefix) and checked by the task's verifier. A step's soft label is
the fraction that reach the right answer, its hard label whether any does; the last step's label is the
solution's own outcome. One JSONL row per solution: ``prompt`` (the text the policy saw), ``steps``, ``soft``,
``hard``, ``correct``, ``uid`` and, for the ``chain`` task, ``truth`` (whether each step is the true running
total). ``label.json`` beside it: counts, prefixes per second.

`fleetrl prm train -c CONFIG --labels FILE`: the learner group trains the registered ``prm`` loss (binary
cross-entropy of the tag probability at every step, :mod:`rewards.prm`) from ``model.path``, in RL's run-dir
layout; the held-out solutions (``prm.eval_fraction`` of the prompts) give ``prm/auc`` (step scores against the
hard Monte-Carlo labels) and, where the rows carry it, ``prm/auc_truth`` (against the true step correctness).
``final/`` is an HF causal LM with ``fleetrl_prm.json``: what ``prm.path`` serves.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from orchestrator.config import ConfigError, FleetConfig
from orchestrator.data import Example, draw, examples_batch, read_jsonl, write_jsonl
from orchestrator.evaluation.search.methods import mc_labels
from orchestrator.rl.driver import Loop, Run, StepOutcome, learner_metrics
from orchestrator.rl.fleet import Roles, training_roles
from orchestrator.rl.reasoning_steps import step_ends, step_separator
from orchestrator.telemetry.metrics import PhaseTimer
from rewards.datasets import DatasetError
from rewards.prm import encode, tag_id, write_meta

log = logging.getLogger("fleetrl")

LABEL_SEED = 7_000_000
"""Offset of the labelling prompts' step index in the task's training stream (disjoint from RL's early steps)."""


def token_steps(tokenizer, completion_ids: list[int], separator: str) -> list[tuple[list[int], str]]:
    """The engine's tokens cut into steps: ``(step token ids, step text)``, a step ending at each token whose text
    holds the separator (and at the last token); steps that are only special tokens are dropped."""
    ends = step_ends([tokenizer.decode([t]) for t in completion_ids], separator)
    out, start = [], 0
    for e in ends:
        ids = completion_ids[start: e + 1]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if text.strip():
            out.append((ids, text))
        start = e + 1
    return out


def run_label(cfg: FleetConfig, out: str, fleet=None) -> dict:
    """Label the policy's solutions (see the module doc); returns the summary written to ``label.json``.
    ``fleet``: run on it (kept up); without one the command's own engines are stopped once they have sampled
    (:meth:`Fleet.for_command`)."""
    from orchestrator.rl.fleet import Fleet, Roles
    from orchestrator.rl.launch import load_tokenizer, make_task
    from rewards.functions import verdicts
    from rewards.tasks import step_truth

    task, sep, p = make_task(cfg), step_separator(cfg), cfg.prm
    tokenizer = load_tokenizer(cfg.model.path)
    prompts = task.train_batch(LABEL_SEED, p.prompts)
    t0 = time.perf_counter()
    with Fleet.for_command(fleet, cfg, Roles(rollout=True)) as serving:
        rollouts = serving.rollouts
        t_up = time.perf_counter()
        samples = rollouts.generate(prompts, p.samples, cfg.rollout.temperature, seed=cfg.rollout.seed)
        solved = [(s, token_steps(tokenizer, s.completion_ids, sep)) for s in samples]
        solved = [(s, steps) for s, steps in solved if steps]
        jobs, prefix_ids = [], []  # (solution index, step index) of every continued prefix
        by_uid = {pr.uid: pr for pr in prompts}
        for i, (_, steps) in enumerate(solved):
            for k in range(len(steps) - 1):
                jobs.append((i, k))
                prefix_ids.append([t for ids, _ in steps[: k + 1] for t in ids])
        t_cont = time.perf_counter()
        conts = rollouts.generate([_job_prompt(by_uid[solved[i][0].prompt_uid], i, k) for i, k in jobs],
                                  p.continuations, cfg.rollout.temperature, seed=cfg.rollout.seed + 1,
                                  prefixes=prefix_ids) if jobs else []
        cont_s = time.perf_counter() - t_cont
    outcomes: dict[tuple[int, int], list[bool]] = {}
    for j, (i, k) in enumerate(jobs):
        s, steps = solved[i]
        prefix = "".join(text for _, text in steps[: k + 1])
        group = conts[j * p.continuations: (j + 1) * p.continuations]
        outcomes[(i, k)] = verdicts(task.verifier_fn, [(s.prompt_text, prefix + c.completion_text, s.metadata)
                                                       for c in group])
    rows = []
    final = verdicts(task.verifier_fn, [(s.prompt_text, s.completion_text, s.metadata) for s, _ in solved])
    for i, (s, steps) in enumerate(solved):
        ok = final[i]
        soft, hard = mc_labels([outcomes[(i, k)] for k in range(len(steps) - 1)] + [[ok]])
        row = {"uid": s.prompt_uid, "prompt": s.prompt_text, "steps": [t for _, t in steps], "soft": soft,
               "hard": hard, "correct": ok}
        if "steps" in s.metadata:  # the chain task: the true running totals
            row["truth"] = step_truth(row["steps"], s.metadata)
        rows.append(row)
    write_jsonl(out, rows)
    summary = {"solutions": len(rows), "steps": sum(len(r["steps"]) for r in rows), "prefixes": len(jobs),
               "continuations": len(conts), "solution_accuracy": sum(r["correct"] for r in rows) / max(len(rows), 1),
               "continuation_seconds": round(cont_s, 2), "prefixes_per_s": round(len(jobs) / cont_s, 1) if jobs else 0,
               "continuation_tokens_per_s": round(sum(len(c.completion_ids) for c in conts) / cont_s, 1)
               if jobs else 0, "seconds": round(time.perf_counter() - t0, 1),
               "actors_seconds": round(t_up - t0, 1), "out": out, "separator": sep}
    Path(out).with_name("label.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)
    return summary


def _job_prompt(prompt, i: int, k: int):
    """The prompt of one continued prefix, with a uid of its own (each prefix's K samples get their own seeds)."""
    from dataclasses import replace

    return replace(prompt, uid=f"{prompt.uid}/{i}/{k}")


def load_labels(path: str | Path) -> list[dict]:
    """Label rows, each checked: ``prompt``, ``steps`` and per-step ``soft``/``hard`` of the same length."""
    rows = []
    for n, row in read_jsonl(path, "PRM labels"):
        where = f"{path}:{n}"
        missing = [k for k in ("prompt", "steps", "soft", "hard", "correct") if k not in row]
        if missing:
            raise DatasetError(f"{where}: a label row needs prompt, steps, soft, hard, correct; missing {missing}")
        if not row["steps"] or not len(row["steps"]) == len(row["soft"]) == len(row["hard"]):
            raise DatasetError(f"{where}: steps, soft and hard must be non-empty lists of one length")
        rows.append(row)
    return rows


def held_out(row: dict, fraction: float) -> bool:
    """Whether a row's prompt is in the held-out share (a stable hash of the prompt: its text, or its chat
    messages as JSON)."""
    prompt = row["prompt"] if isinstance(row["prompt"], str) else json.dumps(row["prompt"], sort_keys=True)
    return zlib.crc32(prompt.encode()) % 1000 < fraction * 1000


def step_targets(row: dict, target: str) -> list[float | None]:
    """The label of every step for ``prm.target``; None where that target trains nothing (``outcome``: all steps
    but the last, which carries the solution's correctness)."""
    if target == "outcome":
        return [None] * (len(row["steps"]) - 1) + [float(row["correct"])]
    return [float(v) for v in row[target]]


@dataclass
class PRMExample(Example):
    """A labelled solution: the tagged completion, mask 1 on the trained tags, their targets."""

    targets: list[float] = field(default_factory=list)


def prm_example(tokenizer, row: dict, tag: int, target: str) -> PRMExample:
    prompt_ids, ids, positions = encode(tokenizer, row["prompt"], row["steps"], tag)
    mask, targets = [0] * len(ids), [0.0] * len(ids)
    for pos, y in zip(positions, step_targets(row, target)):
        if y is not None:
            mask[pos], targets[pos] = 1, y
    return PRMExample(prompt_ids, ids, mask, targets)


def prm_batch(examples: list[PRMExample], size: int, pad_id: int, rows_per_unit: int = 1):
    """:func:`examples_batch` plus the targets in the learner's ``[B, T]`` layout."""
    batch = examples_batch(examples, size, pad_id, rows_per_unit)
    targets = torch.zeros_like(batch.response_mask)
    for i in range(min(len(examples), size)):
        t = examples[i].targets
        targets[i, : len(t)] = torch.tensor(t)
    batch.targets = targets
    return batch


def auc(scores: list[float], labels: list[int]) -> float | None:
    """Area under the ROC curve (scikit-learn); None when the labels are all one class."""
    from sklearn.metrics import roc_auc_score

    if len(set(labels)) < 2:
        return None
    return float(roc_auc_score(labels, scores))


def prm_config(cfg: FleetConfig) -> FleetConfig:
    """The PRM objective's config, ``prm.labels`` read and its held-out split checked."""
    from orchestrator.loops.sft import objective_config

    if not cfg.prm.labels:
        raise ConfigError("prm.labels: give the JSONL written by `fleetrl prm label` (or --labels FILE)")
    split(load_labels(cfg.prm.labels), cfg.prm)
    return objective_config(cfg, {"name": "prm"})  # scored at temperature 1 (specs.learner_temperature)


def split(rows: list[dict], p) -> tuple[list[dict], list[dict]]:
    """(training, held-out) label rows for ``prm.eval_fraction``; both must be non-empty."""
    train = [r for r in rows if not held_out(r, p.eval_fraction)]
    held = [r for r in rows if held_out(r, p.eval_fraction)]
    if not train or not held:
        raise ConfigError(f"prm.labels {p.labels}: {len(train)} training and {len(held)} held-out solutions "
                          f"with prm.eval_fraction={p.eval_fraction}; label more prompts")
    return train, held


class PRMLoop(Loop):
    """A PRM step over ``prm.labels``; its evals are the held-out step AUCs, computed
    from the learner's own tag probabilities: the learner group alone."""

    prepare = staticmethod(prm_config)

    @classmethod
    def roles(cls, cfg: FleetConfig) -> Roles:
        return training_roles(cfg, generates=False, engine_evals=False)

    def __init__(self, run: Run):
        super().__init__(run)
        self.cfg = cfg = run.cfg
        self.tokenizer = run.tokenizer
        p = cfg.prm
        self.tag = tag_id(self.tokenizer, p.tag)
        train, self.held = split(load_labels(p.labels), p)
        self.examples = [prm_example(self.tokenizer, r, self.tag, p.target) for r in train]
        self.examples = [e for e in self.examples if sum(e.loss_mask)]
        log.info("prm labels %s: %d training / %d held-out solutions, target %s", p.labels, len(train),
                 len(self.held), p.target)

    def train_step(self, step: int) -> StepOutcome:
        timer = PhaseTimer()
        n = self.cfg.sequences_per_step
        rows = [self.examples[i] for i in draw(len(self.examples), step, n, self.cfg.trainer.seed)]
        with timer("learn"):
            update = self.run.learn(prm_batch(rows, n, self.run.pad_id))
        return StepOutcome({**learner_metrics(update.metrics), "prm/epoch": (step + 1) * n / len(self.examples),
                           **timer.metrics()}, update.skipped)

    def held_out_scores(self) -> list[list[float]]:
        """The current PRM's score of every step of every held-out solution."""
        n, scores = self.cfg.sequences_per_step, []
        for i in range(0, len(self.held), n):
            chunk = self.held[i: i + n]
            examples = [prm_example(self.tokenizer, r, self.tag, "hard") for r in chunk]
            batch = self.run.fleet.learner.compute_logprobs(prm_batch(examples, n, self.run.pad_id))
            for j, r in enumerate(chunk):
                _, ids, positions = encode(self.tokenizer, r["prompt"], r["steps"], self.tag)
                scores.append([float(batch.old_logprobs[j, pos].exp()) for pos in positions])
        return scores

    def evaluate(self, step: int) -> dict:
        t0 = time.perf_counter()
        scores = self.held_out_scores()
        flat = [v for s in scores for v in s]
        out = {"prm/auc": auc(flat, [y for r in self.held for y in r["hard"]]),
               "prm/auc_outcome": auc([s[-1] for s in scores], [int(r["correct"]) for r in self.held])}
        if all("truth" in r for r in self.held):
            out["prm/auc_truth"] = auc(flat, [int(y) for r in self.held for y in r["truth"]])
        out["time/eval_s"] = time.perf_counter() - t0
        return {k: v for k, v in out.items() if v is not None}

    def on_final(self, final: Path) -> None:
        evals = [m for m in self.run.metrics.history if "prm/auc" in m]
        write_meta(final, {"tag": self.cfg.prm.tag, "separator": step_separator(self.cfg),
                                            "target": self.cfg.prm.target, "labels": self.cfg.prm.labels,
                                            "base": self.cfg.model.path, **({k: evals[-1][k] for k in evals[-1]
                                                                             if k.startswith("prm/auc")}
                                                                          if evals else {})})


def run_prm_train(cfg: FleetConfig, resume: str | None = None, fleet=None) -> list[dict]:
    from orchestrator.rl.driver import run_training

    return run_training(cfg, resume=resume, loop=PRMLoop, fleet=fleet)
