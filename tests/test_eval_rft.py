"""`fleetrl eval` (pass@k, best-of-N) and `fleetrl rft` (rejection-sampling fine-tuning): the estimator
against brute force, the selection rule, the claim that RFT's policy-loss step is the SFT gradient (padding
rows included), and one short run of each command through the real CLI."""

import itertools
import json
from math import comb

import pytest
import torch

from learner.algorithms import loss_kwargs
from learner.batch import response_logprobs
from learner.losses import LossScale, sft_loss
from orchestrator.config import ConfigError, load_config
from orchestrator.data import examples_batch, sample_example
from orchestrator.evaluation.evaluate import best_of_n, parse_ns, pass_at_k, summarize
from orchestrator.loops.rft import keep_verified, rft_config
from tests.conftest import cli, fleetrl
from tests.test_e2e import _check_final_policy
from workers.records import Sample, ScoredSample


def test_pass_at_k_equals_brute_force_over_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - comb(197, 100) / comb(200, 100), rel=1e-9)
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def test_best_of_n_picks_the_highest_score_first_on_ties():
    scores, correct = [0.1, 0.9, 0.9, 0.3], [False, False, True, True]
    assert best_of_n(scores, correct, 1) is False
    assert best_of_n(scores, correct, 2) is False
    assert best_of_n(scores, correct, 3) is False  # tie between index 1 and 2: the first wins
    assert best_of_n([0.0, 0.5, 2.0, 1.0], [False, False, True, False], 4) is True
    with pytest.raises(ValueError):
        best_of_n(scores, correct, 5)
    report = summarize([([0.0, 1.0], [False, True]), ([1.0, 0.0], [False, False])], [1, 2])
    assert report["best_of_n"] == {"1": 0.0, "2": 0.5}
    assert report["pass@k"] == {"1": 0.25, "2": 0.5}
    assert report["sample_accuracy"] == 0.25
    assert parse_ns("16,1,4,4") == [1, 4, 16]
    with pytest.raises(ConfigError, match="--n"):
        parse_ns("1,zero")


def _sample(uid: str, completion: list[int], prompt: list[int] = (3, 4, 5)) -> Sample:
    return Sample(prompt_uid=uid, sample_index=0, prompt_text="", prompt_ids=list(prompt), completion_ids=completion,
                  logprobs=[-1.0] * len(completion), completion_text="", finish_reason="stop", policy_version=0)


def test_keep_verified_thresholds_and_dedupes_per_prompt():
    xs = [ScoredSample(_sample("a", [5, 1]), 1.0, {}), ScoredSample(_sample("a", [5, 1]), 1.0, {}),
          ScoredSample(_sample("a", [6, 1]), 0.0, {}), ScoredSample(_sample("b", [5, 1]), 1.0, {}),
          ScoredSample(_sample("b", [7, 1]), 1.5, {})]
    kept = keep_verified(xs, threshold=1.0)
    assert [(k.sample.prompt_uid, k.sample.completion_ids) for k in kept] == [("a", [5, 1]), ("b", [5, 1]),
                                                                              ("b", [7, 1])]
    assert keep_verified(xs, threshold=2.0) == []
    from workers.records import EpisodeStats  # an agent's own reward (its last turn) counts, as in training

    agent = _sample("c", [8, 1])
    agent.episode = EpisodeStats("done", 1, 0, 0, [], 0, 0, [1], [1.0], False)
    assert keep_verified([ScoredSample(agent, 0.0, {})], threshold=1.0)[0].sample is agent


def test_rft_batch_trains_the_kept_samples_only_and_padding_rows_add_nothing():
    """The kept samples padded to the learner's batch: the sft loss on it has the gradient of the kept samples
    alone; padding rows get zero gradient."""
    torch.manual_seed(0)
    kept = [_sample("a", [5, 6, 1]), _sample("b", [7, 1], prompt=[3, 4]), _sample("c", [8, 9, 9, 1])]
    batch = examples_batch([sample_example(s) for s in kept], size=8, pad_id=1).with_scale()
    assert batch.size == 8 and batch.response_mask[3:].sum() == 0 and batch.scale.num_tokens == 9
    V = 12
    logits = torch.randn(8, batch.input_ids.shape[1], V, requires_grad=True)
    logp, _ = response_logprobs(logits, batch)
    loss, _ = sft_loss(logp, batch.response_mask, batch.scale)
    (grad_rft,) = torch.autograd.grad(loss, logits)

    logits_kept = logits.detach()[:3].clone().requires_grad_(True)
    only = batch.select(slice(0, 3))
    logp_kept, _ = response_logprobs(logits_kept, only)
    nll, _ = sft_loss(logp_kept, only.response_mask, LossScale(3, 9, only.response_mask.shape[1]))
    (grad_sft,) = torch.autograd.grad(nll, logits_kept)
    assert torch.allclose(grad_rft[:3], grad_sft, atol=1e-7)
    assert grad_sft.abs().sum() > 0 and grad_rft[3:].abs().sum() == 0


def test_rft_config_trains_the_sft_objective():
    cfg = rft_config(load_config(None, ["algorithm.name=ppo", "algorithm.kl_coef=0.1", "learner.epochs=3"]), 4)
    assert cfg.algorithm.name == "sft" and not cfg.algorithm.uses_critic
    assert loss_kwargs(cfg.algorithm) == {"objective": "sft"}
    assert cfg.trainer.total_steps == cfg.rft.rounds == 4 and cfg.trainer.eval_every == 1
    assert cfg.learner.epochs == 1 and cfg.learner.num_minibatches == 1
    with pytest.raises(ConfigError, match="--rounds"):
        rft_config(load_config(), 0)


def test_eval_refuses_bad_arguments_before_starting_anything(tmp_path, monkeypatch):
    """Refused before anything starts, and before the embedded default model would be built (1.5 min on a clean
    clone): the model an eval needs is its checkpoint."""
    def no_build(cfg):
        raise AssertionError(f"{cfg.model.path} would be built before the refusal")

    monkeypatch.setattr("orchestrator.cli.main.ensure_model", no_build)
    proc = cli("eval", "--checkpoint", str(tmp_path), "--n", "1,4")
    assert proc.returncode == 2 and "--checkpoint" in proc.stderr and "config.json" in proc.stderr
    proc = cli("eval", "--checkpoint", ".fleetrl/models/arith-base", "--select", "reward_model")
    assert proc.returncode == 2 and "reward.model.path" in proc.stderr


@pytest.mark.e2e
def test_eval_end_to_end(tmp_path):
    """n=1,4 on 16 held-out prompts with the embedded model, selection by the summed (math) reward."""
    out = tmp_path / "eval.json"
    proc = fleetrl("eval", "--checkpoint", ".fleetrl/models/arith-base", "--n", "1,4", "--out", str(out),
                   f"run.dir={tmp_path}", "data.eval_size=16", "rollout.num_workers=1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 16 and report["n"] == [1, 4] and "pass@k" in proc.stdout
    values = [report["greedy_accuracy"], report["sample_accuracy"], *report["pass@k"].values(),
              *report["best_of_n"].values()]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert report["pass@k"]["4"] >= report["pass@k"]["1"] > 0.0
    assert report["pass@k"]["1"] == pytest.approx(report["sample_accuracy"])
    # with the math reward as the selector, best-of-N with N = all samples is "any correct" = pass@N
    assert report["best_of_n"]["4"] == pytest.approx(report["pass@k"]["4"])


@pytest.mark.e2e
def test_rft_end_to_end(tmp_path):
    """Two RFT rounds through the real CLI: correct samples are kept, the policy is updated and pushed each
    round (policy version advances), and the final policy differs from the base model."""
    run_dir = tmp_path / "rft"
    proc = fleetrl("rft", "--rounds", "2", f"run.dir={run_dir}", "data.prompts_per_step=8", "data.eval_size=16",
                   "rollout.num_workers=1", "learner.num_ranks=1", "learner.zero_stage=0", "learner.lr=3e-4",
                   "learner.log_kl=true")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["policy_version"] for r in rows] == [0, 1, 2]
    for r in rows[:2]:
        assert 0.0 < r["rft/kept_fraction"] <= 1.0 and r["rft/kept"] <= 64
        assert r["weight_sync/logprob_max_diff"] < 1e-3 and r["sft/nll"] > 0
    assert all("eval/accuracy" in r for r in rows)
    assert json.loads((run_dir / "summary.json").read_text())["algorithm"] == "rft"
    _check_final_policy(run_dir / "final")
