"""The operator's view: experiment trackers (real TensorBoard, W&B offline and MLflow libraries, read back and
compared with metrics.jsonl), actor output captured into per-actor log files, the console's plain and live modes,
and the filter for vLLM's expected reload warnings. Fast: no Ray, no engines."""

import io
import json
import logging
import math
import os
import subprocess
import sys
import textwrap

import pytest

from orchestrator.config import ConfigError, load_config
from orchestrator.telemetry.console import Console, eval_line
from orchestrator.telemetry.metrics import MetricsLogger
from tests import wandb_offline
from workers.vllm_ext import RELOAD_LOGGER, ExpectedReloadWarnings

ROWS = [
    {"step": 0, "policy_version": 0, "reward/mean": 0.25, "loss": -0.5, "eval/accuracy": 0.3, "note": "text"},
    {"step": 1, "policy_version": 1, "reward/mean": 0.5, "loss": float("nan"), "time/step_s": 1.5},
    {"step": 2, "policy_version": 2, "reward/mean": 0.75, "loss": 0.125, "eval/accuracy": 0.6},
]


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}


def _log_rows(run_dir, rows, loggers, keep_before=0):
    cfg = load_config(None, [f"run.dir={run_dir}", f"run.loggers={json.dumps(loggers)}"])
    m = MetricsLogger(run_dir, plot_every=1000, keep_before=keep_before, loggers=cfg.run.loggers,
                      params=cfg.model_dump(mode="json"))
    for row in rows:
        m.log(row)
    m.close()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mlflow_wandb_and_tensorboard_get_what_metrics_jsonl_holds(tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    jsonl = _log_rows(tmp_path, ROWS, ["jsonl", "tensorboard", "wandb", "mlflow"])
    assert [r["step"] for r in jsonl] == [0, 1, 2]
    expected = {(r["step"], k): v for r in jsonl for k, v in _numbers(r).items()}
    assert len(expected) == 11  # the NaN loss and the string are in the jsonl only

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fleetrl").experiment_id])
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    got = {(m.step, key): m.value for key in run.data.metrics for m in client.get_metric_history(run.info.run_id, key)}
    assert got == expected
    assert run.data.params["rollout.group_size"] == "8" and run.data.params["run.dir"] == str(tmp_path)

    history, config = wandb_offline.read_run(tmp_path)
    assert {(s, k): v for s, row in history.items() for k, v in row.items()} == expected
    assert config["rollout"]["group_size"] == 8 and config["run"]["dir"] == str(tmp_path)

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tb = {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert tb == pytest.approx(expected)


def _run_record(path, wait_s: float = 30.0):
    """The run record of a W&B offline run file; W&B's service process may still be writing it after ``finish``
    returns on a loaded machine (seen under the two-lane unit tier), so it is read again until it is there."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        found = [r.run for r in wandb_offline.records(path) if r.WhichOneof("record_type") == "run"]
        if found or time.monotonic() > deadline:
            assert found, f"no run record in {path}"
            return found[0]
        time.sleep(0.5)


def test_wandb_run_takes_entity_name_and_tags_from_the_config(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.loggers=[jsonl, wandb]", "run.wandb_entity=my-team",
                             "run.wandb_name=gsm8k-grpo", "run.wandb_tags=[smollm2, gsm8k]"])
    m = MetricsLogger(tmp_path, plot_every=1000, loggers=cfg.run.loggers, params=cfg.model_dump(mode="json"))
    m.log(ROWS[0])
    m.close()
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    run = _run_record(path)
    assert (run.entity, run.project, run.display_name, list(run.tags)) == \
        ("my-team", "fleetrl", "gsm8k-grpo", ["smollm2", "gsm8k"])


def test_a_resumed_run_continues_its_mlflow_and_wandb_runs(tmp_path):
    from mlflow.tracking import MlflowClient

    loggers = ["jsonl", "wandb", "mlflow"]
    _log_rows(tmp_path, ROWS[:2], loggers)
    jsonl = _log_rows(tmp_path, [{"step": 1, "policy_version": 1, "reward/mean": 0.9}], loggers, keep_before=1)
    assert [r["step"] for r in jsonl] == [0, 1] and jsonl[1]["reward/mean"] == 0.9
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fleetrl").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")][-1] == (1, 0.9)
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) >= 1
    assert len({p.name.split("-")[-1] for p in (tmp_path / "wandb").glob("offline-run-*")}) == 1  # one run id


@pytest.mark.parametrize("loggers,error", [('["tensorboard"]', "must include 'jsonl'"),
                                           ('["jsonl", "jsonl"]', "listed twice"),
                                           ('["jsonl", "comet"]', "comet")])
def test_bad_loggers_are_named(loggers, error):
    with pytest.raises(ConfigError, match="run.loggers") as e:
        load_config(None, [f"run.loggers={loggers}"])
    assert error in str(e.value)


def test_only_the_expected_reload_warnings_are_dropped():
    def passes(flt, layer, msg="%s: Failed to load weights"):
        return flt.filter(logging.LogRecord(RELOAD_LOGGER, logging.WARNING, "", 0, msg, (layer,), None))

    tied = ExpectedReloadWarnings({"RotaryEmbedding", "ParallelLMHead"})
    untied = ExpectedReloadWarnings({"RotaryEmbedding"})
    assert not passes(tied, "RotaryEmbedding") and not passes(tied, "ParallelLMHead")
    assert passes(untied, "ParallelLMHead")  # untied: a head that got no weights is a real problem
    assert passes(tied, "QKVParallelLinear") and passes(tied, "RotaryEmbedding", "%s: Delayed processing")
    partial = ExpectedReloadWarnings({"RotaryEmbedding"}, partial=True)  # LoRA: only the adapted blocks pushed
    assert not passes(partial, "RMSNorm") and not passes(partial, {"model.norm.weight"},
                                                         "Following weights were not loaded from checkpoint: %s")
    assert passes(untied, {"model.norm.weight"}, "Following weights were not loaded from checkpoint: %s")


CAPTURE = textwrap.dedent("""
    import logging, os, sys
    from common.actor_logs import capture_output
    print("before", flush=True)
    path = capture_output("rollout-7")
    print("python print")
    logging.basicConfig()
    logging.getLogger("vllm").warning("engine warning")
    os.write(1, b"c-level stdout\\n")
    os.write(2, b"c-level stderr\\n")
    print(path, file=sys.__stdout__)
""")


@pytest.mark.parametrize("tee", [False, True])
def test_actor_output_goes_to_its_log_file(tmp_path, tee):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETRL_LOG")}
    env["FLEETRL_LOG_DIR"] = str(tmp_path / "logs")
    if tee:
        env["FLEETRL_LOG_TEE"] = "1"
    for _ in range(2):  # a restarted actor appends to its file
        r = subprocess.run([sys.executable, "-c", CAPTURE], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
    text = (tmp_path / "logs" / "rollout-7.log").read_text()
    for line in ("python print", "engine warning", "c-level stdout", "c-level stderr"):
        assert text.count(line) == 2, (line, text)
        assert (line in r.stdout + r.stderr) == tee, (line, r.stdout, r.stderr)
    assert text.count("==== rollout-7 (pid") == 2 and "before" not in text


def test_capture_output_does_nothing_without_a_log_dir(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETRL_LOG")}
    r = subprocess.run([sys.executable, "-c", CAPTURE], capture_output=True, text=True, env=env, timeout=60)
    assert "python print" in r.stdout and "c-level stderr" in r.stderr and "None" in r.stdout


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_console_plain_lines_without_a_tty_and_a_progress_bar_with_one():
    plain = io.StringIO()
    c = Console(stream=plain)
    c.start(2, 0)
    for row in ROWS:
        c.step(row)
    c.close()
    lines = plain.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].startswith("step    0 v0 reward 0.250") and "eval 0.600" in lines[2]

    tty = _Tty()
    c = Console(stream=tty)
    c.start(3, 0)
    for row in ROWS:
        c.step(row)
    c.close()
    out = tty.getvalue()
    assert "3/3" in out and "reward 0.750" in out and "s/step" in out  # the bar, redrawn with \r
    assert eval_line(ROWS[0]) in out and eval_line(ROWS[2]) in out
    assert "step    1 v1" not in out  # no per-step lines in live mode


def test_the_run_status_file_holds_the_latest_numbers_and_the_state(tmp_path):
    from orchestrator.telemetry.run_status import RunStatus

    status = RunStatus(tmp_path)
    for row in ROWS[:2]:
        status.step(row)
    saved = json.loads((tmp_path / "status.json").read_text())
    assert saved["step"] == 1 and saved["reward"] == 0.5 and saved["state"] == "running"
    assert saved["eval_accuracy"] == 0.3  # the last eval's, kept across steps without one
    status.finish("finished")
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "finished"
    assert not (tmp_path / "status.json.tmp").exists()


def test_supervised_step_lines_show_their_loss_not_eval_only():
    """SFT, DPO and PRM training steps print their own loss; only a step with no metric of its own says so."""
    from orchestrator.telemetry.metrics import progress_line

    prm = progress_line({"step": 3, "policy_version": 3, "prm/bce": 0.41, "prm/accuracy": 0.8, "time/step_s": 2.0})
    assert "prm/bce 0.4100" in prm and "prm/accuracy 0.8000" in prm and "eval only" not in prm
    assert "eval auc 0.737" in progress_line({"step": 50, "policy_version": 50, "prm/auc": 0.737, "prm/bce": 0.4})
    assert "sft/nll 1.2500" in progress_line({"step": 1, "policy_version": 1, "sft/nll": 1.25})
    assert progress_line({"step": 9, "policy_version": 9, "eval/accuracy": 0.5}).endswith("eval 0.500 (eval only)")
