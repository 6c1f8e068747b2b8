"""The learning-rate schedule: `learner.lr_schedule` (constant | linear | cosine) after a linear warmup, decayed to
`min_lr_ratio` over the run's optimizer steps; the learner hands it to DeepSpeed as a torch LambdaLR."""

import math

import pytest
import torch

from learner.worker import lr_factor, lr_scheduler
from orchestrator.config import load_config
from orchestrator.rl.specs import learner_spec


def test_warmup_then_constant_linear_or_cosine_decay_to_the_floor():
    assert [lr_factor(s, "constant", 4, 100, 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = [lr_factor(s, "linear", 0, 10, 0.1) for s in range(12)]
    assert linear[0] == 1.0 and linear[5] == pytest.approx(0.55) and linear[10:] == [pytest.approx(0.1)] * 2
    cosine = [lr_factor(s, "cosine", 2, 12, 0.0) for s in range(14)]
    assert cosine[:3] == [0.5, 1.0, 1.0] and cosine[7] == pytest.approx(0.5) and cosine[12:] == [0.0, 0.0]
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:]))  # never rises after warmup


def test_the_scheduler_steps_the_optimizer_lr():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = lr_scheduler(opt, kind="linear", warmup=0, total=4, min_ratio=0.0)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])


def test_the_learner_spec_carries_the_schedule_over_the_run_s_optimizer_steps():
    cfg = load_config(None, ["learner.lr_schedule=cosine", "learner.warmup_steps=3", "learner.min_lr_ratio=0.1",
                             "trainer.total_steps=50", "learner.num_minibatches=2"])
    spec = learner_spec(cfg)
    assert spec.schedule == {"kind": "cosine", "warmup": 3, "min_ratio": 0.1, "total": 100}
    assert "scheduler" not in spec.ds_config  # the warmup is the schedule's, not DeepSpeed's WarmupLR as well
    constant = learner_spec(load_config(None, ["learner.warmup_steps=3"]))
    assert constant.schedule is None and constant.ds_config["scheduler"]["type"] == "WarmupLR"
    assert not math.isnan(lr_factor(0, "linear", 0, 0, 0.0))  # a run of 0 steps divides by nothing


@pytest.mark.e2e
def test_a_run_s_learner_lr_follows_the_schedule(tmp_path):
    """Only this test guards the schedule reaching DeepSpeed's engine in the learner ranks: 3 steps of linear decay
    to 0 train at lr x 1, 2/3 and 1/3 (`actor/lr`, the LR of each step's optimizer step). The same run guards the
    sampled evals (`trainer.eval_samples`): pass@1 over k samples and maj@k beside greedy accuracy."""
    from tests.test_e2e import run_fleetrl

    rows = run_fleetrl(tmp_path / "run", "learner.lr_schedule=linear", "learner.lr=3e-4", "trainer.total_steps=3",
                       "trainer.eval_every=3", "trainer.eval_samples=4", "data.eval_size=32", "rollout.num_workers=1",
                       "learner.num_ranks=1", "learner.zero_stage=0")
    lrs = [r["actor/lr"] for r in rows if "actor/lr" in r]
    assert lrs == pytest.approx([3e-4, 2e-4, 1e-4]), lrs
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]
    assert 0.0 < evals[0]["eval/pass@1"] < 1.0, evals[0]  # the base model is right on some samples at T = 1
    for r in evals:  # 32 prompts x 4 samples: a multiple of 1/128; the voted answers: of 1/32
        assert (r["eval/pass@1"] * 128).is_integer() and (r["eval/maj@4"] * 32).is_integer(), r
