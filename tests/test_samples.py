"""What the model writes, where a person looks: the restate monitor, the eval sample files, the samples shown on
the console and as text in the real TensorBoard / MLflow libraries (read back), and MLflow's own environment
variables. Fast: no Ray, no engines."""

import json
from types import SimpleNamespace

import pytest

from orchestrator.config import load_config
from orchestrator.telemetry.console import sample_line
from orchestrator.telemetry.metrics import MetricsLogger
from orchestrator.telemetry.samples import eval_records, restate_frac, restates_prompt, shown, write_eval_samples
from rewards.datasets import DatasetError, DatasetTask

PROMPT = "<|im_start|>user\nWhat is 64 + 95?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("completion,restates", [
    ("64 + 95", True), ("64 + 95 =", True), ("What is 64 + 95?", True), ("\\boxed{64 + 95}", True),
    ("159", False), ("64 + 95 = 159", False), ("The sum of 64 and 95 is 159.", False), ("", False),
])
def test_restating_the_prompt_is_seen(completion, restates):
    assert restates_prompt(PROMPT, completion) is restates


def _sample(completion, answer="159", uid="eval-0"):
    return SimpleNamespace(prompt_uid=uid, prompt_text=PROMPT, completion_text=completion, metadata={"answer": answer})


def test_eval_samples_are_written_with_their_verdicts(tmp_path):
    samples = [_sample("64 + 95"), _sample("159", uid="eval-1"), _sample("158", uid="eval-2")]
    records = eval_records(samples, [False, True, False])
    path = write_eval_samples(tmp_path, 10, records)
    assert path == tmp_path / "evals" / "step_10.jsonl" and not list(tmp_path.glob("evals/*.tmp"))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["uid"], r["completion"], r["correct"], r["restates_prompt"]) for r in rows] == [
        ("eval-0", "64 + 95", False, True), ("eval-1", "159", True, False), ("eval-2", "158", False, False)]
    assert restate_frac(samples) == pytest.approx(1 / 3)
    assert [r["uid"] for r in shown(records, 2)] == ["eval-0", "eval-1"]  # one wrong, one right
    assert [r["uid"] for r in shown(records, 3)] == ["eval-0", "eval-2", "eval-1"]
    assert shown(records, 0) == [] and "wrong (answer 159)" in sample_line(10, records[0])


def test_eval_samples_reach_tensorboard_and_mlflow_as_text(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = f"sqlite:///{tmp_path / 'team.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-exp")
    MlflowClient(uri).create_experiment("team-exp", artifact_location=(tmp_path / "server-artifacts").as_uri())
    cfg = load_config(None, [f"run.dir={tmp_path}", 'run.loggers=["jsonl", "tensorboard", "mlflow"]'])
    m = MetricsLogger(tmp_path, plot_every=1000, loggers=cfg.run.loggers, params=cfg.model_dump(mode="json"))
    m.log_samples(eval_records([_sample("64 + 95")], [False]), step=5)
    m.log({"step": 5, "eval/accuracy": 0.0})
    m.close()
    assert not (tmp_path / "mlflow.db").exists()  # the team's server (here a file) got the run, not a private one
    assert any((tmp_path / "server-artifacts").rglob("*.md")) and not (tmp_path / "mlflow-artifacts").exists()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("team-exp").experiment_id])
    (folder,) = client.list_artifacts(run.info.run_id, "eval/samples")
    text = (tmp_path / "dl").mkdir() or client.download_artifacts(run.info.run_id, folder.path, str(tmp_path / "dl"))
    assert "64 + 95" in open(text).read()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert any("64 + 95" in e.tensor_proto.string_val[0].decode() for e in events.Tensors("eval/samples/text_summary"))


def test_answer_form_number_refuses_a_symbolic_reference_at_load(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"prompt": "x?", "answer": "x+1"})
                    + "\n" + json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    with pytest.raises(DatasetError, match=r"d.jsonl:2: .*answer_form=number.*'x\+1'"):
        DatasetTask(str(data), "prompt", "answer", False, eval_size=1, seed=0, answer_form="number")
    task = DatasetTask(str(data), "prompt", "answer", False, eval_size=1, seed=0, answer_form="expression")
    assert task.eval_set(1)[0].metadata == {"answer": "4", "answer_form": "expression"}
