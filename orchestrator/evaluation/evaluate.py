"""`fleetrl eval`: how good is a checkpoint when it may sample N times?

The rollout engines (vLLM) load the checkpoint, the reward actors score; for each held-out prompt of the
config's task it reports

- greedy accuracy (one temperature-0 completion),
- pass@k for each requested k: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code"), ``1 - C(n - c, k) / C(n, k)`` from ``n`` = max N samples of which ``c`` are correct,
  averaged over prompts,
- best-of-N accuracy for each N: among the first N samples of a prompt the one with the highest selection
  score (the summed reward, or the reward model's score) is picked, ties to the first, and checked.

Correctness is the task's verifier (:func:`rewards.functions.is_correct`): ``math`` for ``arithmetic`` and
``multi``, ``countdown`` for ``countdown`` (stating the target number is not a solution), ``data.verifier`` for
a dataset. The selection score is what a deployed system could compute without the reference answer (with
``--select reward`` and the verifier among the rewards the selector sees the answer, so best-of-N is then an
upper bound, equal to pass@N).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from orchestrator.config import ConfigError, FleetConfig

log = logging.getLogger("fleetrl")

SELECTORS = ("reward", "reward_model")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct: ``1 - C(n-c, k) / C(n, k)``, the probability
    that a random k-subset holds a correct sample; computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``
    (Chen et al. 2021, numerically stable for large n)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def best_of_n(scores: list[float], correct: list[bool], n: int) -> bool:
    """Whether the highest-scoring of the first ``n`` samples is correct (ties: the first of them)."""
    if not 1 <= n <= len(scores) or len(scores) != len(correct):
        raise ValueError(f"best-of-{n} needs 1 <= n <= {len(scores)} scores and one correctness per score")
    head = scores[:n]
    return bool(correct[max(range(n), key=head.__getitem__)])


def summarize(groups: list[tuple[list[float], list[bool]]], ns: list[int]) -> dict:
    """pass@k and best-of-N accuracy for each value in ``ns``, averaged over prompts; ``groups`` holds each
    prompt's (selection scores, correctness) of its ``max(ns)`` samples, in sampling order."""
    n_max = max(ns)
    counts = [sum(ok) for _, ok in groups]
    return {
        "pass@k": {str(k): sum(pass_at_k(n_max, c, k) for c in counts) / len(groups) for k in ns},
        "best_of_n": {str(n): sum(best_of_n(s, ok, n) for s, ok in groups) / len(groups) for n in ns},
        "sample_accuracy": sum(counts) / (n_max * len(groups)),
    }


def parse_ns(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (sorted, unique, each >= 1)."""
    try:
        ns = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--n {text!r}: give comma-separated positive integers, e.g. 1,4,16") from None
    if not ns or ns[0] < 1:
        raise ConfigError(f"--n {text!r}: give comma-separated positive integers, e.g. 1,4,16")
    return ns


def resolve_model_dir(checkpoint: str) -> Path:
    """An HF model directory from ``--checkpoint``: the directory itself, a run's ``final/`` or a fleetrl
    checkpoint's ``policy/``."""
    from common.hub import HubError, resolve

    try:
        path = Path(resolve(checkpoint, "--checkpoint").path)
    except HubError as e:
        raise ConfigError(str(e)) from None
    for candidate in (path, path / "final", path / "policy"):
        if (candidate / "config.json").exists():
            return candidate
    raise ConfigError(f"--checkpoint {checkpoint!r}: no HF model there (config.json in it, in final/ or in "
                      "policy/); give a run's final/ directory, a checkpoint directory or an HF model directory")


def check_selector(cfg: FleetConfig, select: str) -> None:
    """``--select``: a known selector, and ``reward_model`` only with ``reward.model.path``."""
    if select not in SELECTORS:
        raise ConfigError(f"--select {select!r}: choose one of {list(SELECTORS)}")
    if select == "reward_model" and not cfg.reward.model.path:
        raise ConfigError("--select reward_model needs a reward model: set reward.model.path")


def run_eval(cfg: FleetConfig, checkpoint: str, ns: list[int], select: str = "reward",
             out: str | None = None, fleet=None) -> dict:
    """Generate ``max(ns)`` samples per held-out prompt with the checkpoint, score, summarize; writes the
    report as JSON (``out``, default ``<run.dir>/eval.json``) and returns it. ``fleet``: run on it (kept up); without
    one the command's own fleet is stopped before the report is written (:meth:`Fleet.for_command`)."""
    check_selector(cfg, select)
    cfg = cfg.model_copy(deep=True)
    cfg.model.path = str(resolve_model_dir(checkpoint))
    from orchestrator.rl.fleet import Fleet, Roles
    from orchestrator.rl.launch import make_task
    from rewards.functions import verdicts, verify_timeouts

    task = make_task(cfg)
    prompts, verifier = task.eval_set(cfg.data.eval_size), task.verifier_fn
    t0 = time.perf_counter()
    n_max = max(ns)
    with Fleet.for_command(fleet, cfg, Roles(rollout=True, reward=True)) as serving:
        rollouts, rewards = serving.rollouts, serving.rewards
        what = "tool episodes" if cfg.env.multi_turn else "completions"
        log.info("eval: %d greedy %s, then %d x %d sampled (%d engines)", len(prompts), what, len(prompts), n_max,
                 len(rollouts.workers))
        greedy = rollouts.generate(prompts, 1, temperature=0.0, seed=None)
        log.info("eval: greedy done in %.0fs; sampling", time.perf_counter() - t0)
        sampled = rollouts.generate(prompts, n_max, cfg.rollout.temperature, seed=cfg.rollout.seed)
        scored, errors = rewards.score(sampled)
    groups = []
    for g in range(len(prompts)):
        group = scored[g * n_max: (g + 1) * n_max]
        sel = [x.reward if select == "reward" else x.components["reward_model"] for x in group]
        groups.append((sel, verdicts(verifier, [(x.sample.prompt_text, x.sample.completion_text, x.sample.metadata)
                                                for x in group])))
    report = {
        "checkpoint": checkpoint, "model_path": cfg.model.path, "num_prompts": len(prompts), "n": ns,
        "temperature": cfg.rollout.temperature, "seed": cfg.rollout.seed, "select": select,
        "greedy_accuracy": sum(verdicts(verifier, [(s.prompt_text, s.completion_text, s.metadata)
                                                   for s in greedy])) / len(greedy),
        "verify_timeouts": verify_timeouts(),
        **summarize(groups, ns), **(_episodes(greedy) if cfg.env.multi_turn else {}), "reward_errors": errors,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    path = Path(out) if out else Path(cfg.run.dir) / "eval.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(format_table(report), flush=True)
    log.info("eval report written to %s", path)
    return report


def _episodes(greedy: list) -> dict:
    """The greedy episodes' tool use (``env.name`` set): the ``eval/*`` numbers a training run logs."""
    from orchestrator.rl.episode_metrics import eval_episode_metrics

    return {"greedy_" + k.removeprefix("eval/"): v for k, v in eval_episode_metrics(greedy).items()}


def format_table(report: dict) -> str:
    """The report as a small console table."""
    lines = [f"{report['model_path']}: {report['num_prompts']} prompts, temperature {report['temperature']}, "
             f"best-of-N selected by {report['select']}",
             f"greedy accuracy {report['greedy_accuracy']:.3f}   mean sample accuracy {report['sample_accuracy']:.3f}",
             f"{'N=k':>6} {'pass@k':>8} {'best-of-N':>10}"]
    lines += [f"{n:>6} {report['pass@k'][str(n)]:>8.3f} {report['best_of_n'][str(n)]:>10.3f}" for n in report["n"]]
    tools = [f"{k.removeprefix('greedy_')} {v:.3f}" for k, v in report.items()
             if k.startswith("greedy_") and k != "greedy_accuracy"]
    if tools:
        lines.append("greedy episodes: " + ", ".join(tools))
    return "\n".join(lines)
