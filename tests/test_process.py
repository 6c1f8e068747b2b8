"""Process supervision end to end with real actors on tiny budgets: Math-Shepherd labels from the rollout engines
-> a PRM trained on the learner group -> the PRM served by `prm-i` actors as the process reward of GRPO -> PRM-guided
search through the engines, every method, with its report and curve."""

import json
import subprocess

import pytest

from orchestrator.models.embedded_model import init_model
from tests.conftest import fleetrl
from tests.test_pipeline import _rows

SMALL = ["data.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=8", "rollout.num_workers=1",
         "learner.num_ranks=1", "learner.zero_stage=0"]


def _fleetrl(*args, timeout=600) -> subprocess.CompletedProcess:
    proc = fleetrl(*args, timeout=timeout)  # on the session's shared fleet: label, train and search share actors
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc


@pytest.mark.e2e
def test_label_train_serve_process_rl_and_search(tmp_path):
    model = tmp_path / "chain-base"  # a short warm start: the plumbing, not the accuracy, is under test here
    init_model(model, kind="chain", target_accuracy=None, max_steps=100, batch_size=128, log=lambda *_: None)
    base = ["-c", "configs/chain.yaml", f"model.path={model}", *SMALL]

    labels = tmp_path / "labels.jsonl"
    _fleetrl("prm", "label", *base, f"--out={labels}", "prm.prompts=16", "prm.samples=2", "prm.continuations=4")
    rows = [json.loads(line) for line in labels.read_text().splitlines()]
    assert len(rows) >= 24
    for r in rows:
        assert len(r["steps"]) == len(r["soft"]) == len(r["hard"]) == len(r["truth"]) >= 1
        assert r["soft"][-1] == float(r["correct"]) and all(0.0 <= v <= 1.0 for v in r["soft"])
        assert all(h == int(s > 0) for s, h in zip(r["soft"], r["hard"]))
    summary = json.loads((tmp_path / "label.json").read_text())
    assert summary["prefixes"] == sum(len(r["steps"]) - 1 for r in rows) > 0 and summary["prefixes_per_s"] > 0

    prm_dir = tmp_path / "prm"
    _fleetrl("prm", "train", *base, f"--labels={labels}", "prm.eval_fraction=0.3", "trainer.total_steps=4",
             "trainer.eval_every=2", "learner.lr=1e-3", f"run.dir={prm_dir}")
    trained = [r for r in _rows(prm_dir) if "prm/bce" in r]
    assert len(trained) == 4 and trained[-1]["prm/bce"] < trained[0]["prm/bce"]
    assert not list((prm_dir / "logs").glob("rollout-*.log"))  # a PRM trains on the learner group alone
    meta = json.loads((prm_dir / "final" / "fleetrl_prm.json").read_text())
    assert meta["tag"] == ")" and meta["separator"] == ";" and meta["target"] == "soft"

    rl_dir = tmp_path / "rl"
    _fleetrl("train", *base, "algorithm.name=grpo_process", f"prm.path={prm_dir / 'final'}", "trainer.total_steps=2",
             "trainer.eval_every=2", f"run.dir={rl_dir}")
    steps = [r for r in _rows(rl_dir) if "process/step_reward_mean" in r]
    assert len(steps) == 2 and all(r["process/steps_per_sample"] >= 1 for r in steps)
    assert (rl_dir / "logs" / "prm-0.log").exists()  # the PRM was served by its own actor

    out = tmp_path / "search"
    methods = "greedy,majority,prm_best_of_n:min,prm_best_of_n:prod,prm_beam,mcts,revision"
    _fleetrl("eval", *base, "--search", methods, "--budgets", "1,2", f"prm.path={prm_dir / 'final'}",
             f"--out={out}")
    report = json.loads((out / "search.json").read_text())
    assert set(report["methods"]) == set(methods.split(","))
    assert [r["budget"] for r in report["methods"]["greedy"]] == [1]
    for method, results in report["methods"].items():
        assert all(0.0 <= r["accuracy"] <= 1.0 and r["tokens_per_problem"] > 0 for r in results), method
    assert (out / "search.png").stat().st_size > 10_000
