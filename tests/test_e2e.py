"""End to end on a real local Ray cluster: 2 vLLM rollout actors, 1 reward actor, 2 DeepSpeed learner ranks
(ZeRO-2), the real `fleetrl train` entry point. No mocks. Checks that weights really reached the engines, that
the metrics file is complete, and that the final policy loads in transformers with the learner's logprobs."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FLEET_SERVER, shared_ray_env, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ["step", "policy_version", "reward/mean", "reward/std", "train/accuracy", "loss", "kl", "clip_frac",
            "entropy", "tokens_generated", "time/generate_s", "time/reward_s", "time/learn_s", "time/sync_s",
            "time/step_s", "weight_sync/logprob_max_diff", "rollout/logprob_gap_max", "rollout/staleness_max",
            "train/restate_frac"]


def train(run_dir: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`fleetrl train` as a user runs it (not a TTY here, so the console prints one line per step)."""
    env = subprocess_env(RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", **shared_ray_env())
    config = list(args[:2]) if args[:1] == ("-c",) else []  # a config file goes before the overrides
    cmd = [sys.executable, "-m", "orchestrator", "train", *config, f"run.dir={run_dir}", *args[len(config):]]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_fleetrl(run_dir: Path, *args: str, timeout: int = 600, env: dict | None = None) -> list[dict]:
    """`fleetrl train` on the session's shared fleet (tests/fleet_server.py: the actors of the previous run that fit
    this one are kept), with ``env`` set for it; its metrics rows."""
    config = list(args[:2]) if args[:1] == ("-c",) else []
    proc = FLEET_SERVER.run(["train", *config, f"run.dir={run_dir}", *args[len(config):]], timeout, env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_grpo_three_steps_real_stack(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(run_dir, "trainer.total_steps=3", "trainer.eval_every=3", "rollout.num_workers=2",
                 "reward.num_workers=1", "learner.num_ranks=2", "learner.zero_stage=2", "data.eval_size=32",
                 "learner.lr=1e-3", "learner.log_kl=true", "run.loggers=[jsonl, tensorboard, wandb, mlflow]")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["policy_version"] for r in rows] == [0, 1, 2, 3]
    for r in train_rows:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        # the engines' logprobs of their probe tokens equal the learner's after the push: the weights arrived;
        # and the batch was sampled by the weights the learner trained from
        assert r["weight_sync/logprob_max_diff"] < 1e-3, r["weight_sync/logprob_max_diff"]
        assert r["rollout/logprob_gap_max"] < 1e-3 and r["rollout/staleness_max"] == 0
        assert r["rollout/policy_version_min"] == r["policy_version"]
        assert r["tokens_generated"] > 0 and r["time/step_s"] > 0
        assert all(abs(r[k]) < 1e6 for k in ("loss", "kl", "entropy"))
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    # start-up is timed from the loaded config: to every actor ready, then to the end of the first step (which
    # holds the step-0 eval), in the first row only and in the summary
    startup, first_step = rows[0]["time/startup_s"], rows[0]["time/first_step_s"]
    assert 0 < startup < first_step and not any("time/startup_s" in r for r in rows[1:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["startup_s"], summary["first_step_s"]) == (round(startup, 1), round(first_step, 1))
    _check_eval_samples(run_dir, rows)
    assert len(list((run_dir / "mlflow-artifacts").rglob("step_*.md"))) == 2  # the eval samples, in the run dir
    # the policy moved away from the reference after the first update (so weights really changed)
    assert train_rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and train_rows[-1]["kl"] > 1e-5
    assert (run_dir / "config.yaml").exists() and (run_dir / "progress.png").stat().st_size > 1000
    assert any((run_dir / "tensorboard").iterdir())
    _check_final_policy(run_dir / "final")
    _check_console(proc, run_dir, steps=4)
    _check_trackers(run_dir, rows)


def _check_eval_samples(run_dir: Path, rows: list[dict]) -> None:
    """Every eval wrote its greedy completions with their verdicts, and its accuracy is theirs."""
    for r in (r for r in rows if "eval/accuracy" in r):
        path = run_dir / "evals" / f"step_{r['step']}.jsonl"
        samples = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(samples) == 32
        assert {"prompt", "completion", "answer", "correct", "restates_prompt"} <= set(samples[0])
        assert sum(s["correct"] for s in samples) / 32 == pytest.approx(r["eval/accuracy"])
        assert sum(s["restates_prompt"] for s in samples) / 32 == pytest.approx(r["eval/restate_frac"])


RAY_NODE_WARNING = re.compile(r"\(raylet\).*WARNING: \d+ PYTHON worker processes have been started on node")
"""Ray's raylet tells every driver of a node when many worker processes started at once (4x its CPU count, 8 on
2 cores): on the session's shared head it depends on what the tests before left running, and it is Ray's line,
not fleetrl's (the suite met it once, after the on-policy distillation test)."""


def _check_console(proc: subprocess.CompletedProcess, run_dir: Path, steps: int) -> None:
    """The console holds fleetrl's banner, one line per step, two eval samples under each of the two evals and
    the closing line; the engines' output is in the per-actor log files."""
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if not RAY_NODE_WARNING.search(line)]
    assert len(lines) <= 12 + steps + 4, "\n".join(lines)
    assert sum(line.startswith("eval  step") and ("right (answer" in line or "wrong (answer" in line)
               for line in lines) == 4
    assert sum(line.startswith("step ") for line in lines) == steps
    assert any(line.startswith("  actors       2 rollout (vLLM), 1 reward, learner 2 ranks")
               and re.search(r"; up \d+\.\d s after the config was loaded$", line) for line in lines)
    assert proc.stdout.splitlines()[-1].startswith("done: 3 steps")
    engine_lines = [line for line in lines if re.search(r"pid=|MainProcess|\b(INFO|WARNING|DEBUG)\b", line)]
    assert not engine_lines, "\n".join(lines)
    logs = run_dir / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["driver.log", "learner-0.log", "learner-1.log", "reward-0.log",
                                                      "rollout-0.log", "rollout-1.log"]
    for i in (0, 1):
        engine = (logs / f"rollout-{i}.log").read_text()
        assert "Initializing a V1 LLM engine" in engine and "Reloading weights inplace" in engine
        assert "Failed to load weights" not in engine  # the two expected reload warnings are filtered
    assert (logs / "learner-0.log").read_text().startswith("==== learner-0 (pid ")


def _check_trackers(run_dir: Path, rows: list[dict]) -> None:
    """MLflow's client and W&B's offline run file give back exactly the finite numbers of metrics.jsonl."""
    import math

    from mlflow.tracking import MlflowClient

    from tests import wandb_offline

    expected = {(r["step"], k): v for r in rows for k, v in r.items()
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fleetrl").experiment_id])
    got = {(m.step, key): m.value for key in run.data.metrics for m in client.get_metric_history(run.info.run_id, key)}
    assert got == expected
    assert run.data.params["learner.num_ranks"] == "2"
    history, config = wandb_offline.read_run(run_dir)
    samples = "eval/samples/"  # the eval samples' table (its W&B summary fields), not a metric
    assert {(s, k): v for s, row in history.items() for k, v in row.items() if not k.startswith(samples)} == expected
    assert {s for s, row in history.items() if row.get(samples + "nrows") == 2} == {0, 3}
    assert config["learner"]["num_ranks"] == 2


def _check_final_policy(final: Path):
    """The exported policy loads in transformers and differs from the base model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator.config import EMBEDDED_MODEL_PATH

    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    base = AutoModelForCausalLM.from_pretrained(ROOT / EMBEDDED_MODEL_PATH).eval()
    ids = tok(["12+30="], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = model(ids).logits, base(ids).logits
    assert torch.isfinite(a).all() and not torch.allclose(a, b)
    assert tok.decode(tok("45+9=")["input_ids"]) == "45+9="


def even_prompts_only(prompt, completion, metadata):
    """The math reward on prompts whose first operand is even; 0 on the others, so about half of all groups have
    equal rewards (zero advantage), which dynamic sampling must set aside."""
    from rewards.functions import math_reward

    return math_reward(prompt, completion, metadata) if int(prompt.split("+")[0]) % 2 == 0 else 0.0


@pytest.mark.e2e
@pytest.mark.parametrize("algorithm,extra", [
    ("rloo", ["rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=3",  # and bf16 engines + autocast
              "rollout.dtype=bfloat16", "learner.mixed_precision=bfloat16", "run.dump_rollouts=true",
              "reward.functions=[{name: 'tests.test_e2e:even_prompts_only'}]"]),
    ("ppo", ["algorithm.kl_reward_coef=0.05", "algorithm.rejection=geometric"]),  # the critic trains on every token
    ("gdpo", ["reward.functions=[{name: math}, {name: length, params: {max_len: 5, cache: 3}}]",
              "algorithm.conditions=[{reward: length, if_reward: math, threshold: 1.0}]",
              "rollout.weight_sync=collective", "learner.log_kl=true"]),  # pushes over a gloo group into the engine
])
def test_algorithm_families_end_to_end(tmp_path, algorithm, extra):
    """A group-based estimator, PPO with its critic group (GAE), and GDPO with two reward components (and the
    collective weight push), through the real loop (1 rollout worker, 1 learner rank at ZeRO-0 to keep the suite
    short; GRPO with process advantages runs in the one_step_off test). The logprob check proves the pushed weights
    arrived, whichever way they went."""
    rows = run_fleetrl(tmp_path / "run", f"algorithm.name={algorithm}", *extra, "trainer.total_steps=2",
                       "trainer.eval_every=0", "rollout.num_workers=1", "learner.num_ranks=1", "learner.zero_stage=0",
                       "learner.lr=1e-3")
    assert [r["step"] for r in rows] == [0, 1, 2]
    bf16 = "rollout.dtype=bfloat16" in extra
    for r in rows[:2]:  # bf16 engines differ from the fp32 learner by rounding: the push is checked in fp32 runs
        assert 0 < r["weight_sync/logprob_max_diff"] < 0.5 if bf16 else r["weight_sync/logprob_max_diff"] < 1e-3
        assert abs(r["loss"]) < 1e6
        if algorithm != "ppo":  # batch used once: the old logprobs are the update's first pass, no separate pass
            assert r["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    if algorithm == "rloo":  # dynamic sampling: about half the groups are uninformative, so one round is never enough
        for r in rows[:2]:
            rounds, kept = r["sampling/rounds"], r["sampling/informative_groups"]
            assert 2 <= rounds <= 3 and (kept >= 16 or rounds == 3)
            dumped = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / f"step_{r['step']:06d}.jsonl")
                      .read_text().splitlines()]
            groups: dict = {}
            for row in dumped:
                groups.setdefault(row["uid"], set()).add(row["reward"])
            informative = [len(v) > 1 for v in groups.values()]
            assert len(groups) == 16 and sum(informative) == min(16, kept)
            assert informative == sorted(informative, reverse=True)  # set-aside groups only top the batch up
    if algorithm == "ppo":
        assert "critic/value_loss" in rows[0] and rows[0]["critic/value_loss"] > 0
        # fp32 engines sampling with the learner's own weights: the sequence rejection keeps everything
        assert rows[0]["off_policy/rejected_seq_frac"] == 0 and rows[0]["off_policy/mismatch_kl"] < 1e-6
    if algorithm == "gdpo":
        assert "reward/math" in rows[0] and "reward/length" in rows[0]
        assert rows[1]["kl"] > 0  # the update moved the policy


@pytest.mark.e2e
def test_one_step_off_generates_next_batch_during_update(tmp_path):
    """rollout.mode=one_step_off: batch k+1 is generated (with version k) while the learner trains on batch k;
    samples are exactly one version stale after the first step and the engines still get every push. The run is
    also the algorithm-family case of GRPO with process (per-step) advantages, and the off-policy rejection's: a
    token whose pi_old / pi_rollout lies outside [0.99, 1.01] leaves the update (learner.corrections)."""
    rows = run_fleetrl(tmp_path / "run", "rollout.mode=one_step_off", "algorithm.name=grpo_process",
                       "algorithm.step_separator=''", "trainer.total_steps=3", "trainer.eval_every=0",
                       "rollout.num_workers=1", "learner.num_ranks=1", "learner.zero_stage=0", "learner.lr=1e-3",
                       "algorithm.rejection=token", "algorithm.rejection_band=[0.99, 1.01]")
    train = [r for r in rows if "reward/mean" in r]
    assert all(abs(r["loss"]) < 1e6 for r in train)
    assert [r["rollout/staleness_max"] for r in train] == [0, 1, 1]
    assert [r["rollout/policy_version_min"] for r in train] == [0, 0, 1]
    assert train[0]["rollout/logprob_gap_max"] < 1e-3  # same-version samples
    for r in train:  # every push arrived, also while the engines were one step ahead
        assert r["weight_sync/logprob_max_diff"] < 1e-3
    for r in train[1:]:  # stale samples: generated during the previous update, which moved the policy
        assert r["time/generate_overlapped_s"] > 0 and r["rollout/logprob_gap_max"] > 1e-3
    assert [r["rollout/queue_depth"] for r in train] == [16, 16, 0]
    # the rejection's logprob pass gives the old (proximal) logprobs: the update starts from them (ratio 1); the
    # same-version batch loses nothing, each stale batch a part, and the update's own first pass saw only the kept
    # tokens (its largest gap inside the band) while the batch's gap is wider
    assert all(r["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6) for r in train)
    assert train[0]["off_policy/rejected_token_frac"] == 0 and train[0]["off_policy/mismatch_kl"] < 1e-6
    for r in train[1:]:
        assert 0 < r["off_policy/rejected_token_frac"] < 1 and r["off_policy/mismatch_kl"] > 0
        assert r["actor/rollout_logprob_gap_max"] <= -math.log(0.99) + 1e-6 < r["rollout/logprob_gap_max"]
    assert all(0 <= r["time/overhead_s"] < r["time/step_s"] for r in train)
