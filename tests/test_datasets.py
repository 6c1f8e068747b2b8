"""JSONL and Parquet datasets: field mapping, the GSM8K layout, and bad rows reported with file and line/row."""

import json
from pathlib import Path

import pytest

from orchestrator.config import ConfigError, load_config
from rewards.datasets import DatasetError, DatasetTask, gsm8k_answer
from rewards.functions import REWARD_FUNCTIONS, math_reward
from rewards.tasks import countdown_reward
from tests.conftest import cli

SAMPLE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"
ROOT = Path(__file__).resolve().parents[1]


def test_gsm8k_layout_and_eval_split():
    task = DatasetTask(str(SAMPLE), "question", "answer", False, eval_size=2, seed=0)
    assert len(task.train_rows) == 3 and len(task.eval_rows) == 2
    ev = task.eval_set(2)
    assert ev[0].metadata["answer"] == "300" and ev[1].metadata["answer"] == "70"  # "1,200 ... #### 300"
    batch = task.train_batch(5, 3)
    assert {p.text for p in batch} <= {r[0] for r in task.train_rows}
    assert [p.text for p in batch] == [p.text for p in task.train_batch(5, 3)]  # deterministic per step
    assert math_reward(ev[1].text, "So it takes \\boxed{70} days.", ev[1].metadata) == 1.0
    assert gsm8k_answer("x\n#### 1,234") == "1234" and gsm8k_answer("42") == "42"


def test_dataset_verifier_is_data_verifier(monkeypatch):
    assert DatasetTask(str(SAMPLE), "question", "answer", False, eval_size=2, seed=0).verifier_fn is math_reward
    task = DatasetTask(str(SAMPLE), "question", "answer", False, eval_size=2, seed=0, verifier="choice")
    assert task.verifier == "choice" and task.verifier_fn is REWARD_FUNCTIONS["choice"]
    with pytest.raises(KeyError, match="unknown reward function 'nope'; built-ins"):
        DatasetTask(str(SAMPLE), "question", "answer", False, eval_size=2, seed=0, verifier="nope")
    from orchestrator.rl import launch  # the run's make_task hands data.verifier on

    monkeypatch.setattr(launch, "load_tokenizer", lambda path: lambda text: {"input_ids": text.split()})
    cfg = load_config(overrides=[f"data.path={SAMPLE}", "data.prompt_field=question", "data.eval_size=2",
                                 "data.verifier=rewards.tasks:countdown_reward"])
    assert launch.make_task(cfg).verifier_fn is countdown_reward


def test_data_verifier_is_checked_at_load():
    assert load_config(overrides=["data.verifier=countdown"]).data.verifier == "countdown"
    with pytest.raises(ConfigError, match=r"data\.verifier: .*unknown reward function 'nope'; built-ins: \[.*'math'"):
        load_config(overrides=["data.verifier=nope"])
    with pytest.raises(ConfigError, match=r"data\.verifier: .*cannot import the verifier 'nosuch\.mod:fn'"):
        load_config(overrides=["data.verifier=nosuch.mod:fn"])
    with pytest.raises(ConfigError, match=r"data\.verifier: .*rewards\.tasks has no callable 'nope'"):
        load_config(overrides=["data.verifier=rewards.tasks:nope"])


def _write(tmp_path, lines):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines) + "\n")
    return f


def test_missing_field_fails_with_file_and_line(tmp_path):
    f = _write(tmp_path, ['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "2+2="}', '{"prompt": "3+3=", "answer": 6}'])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: missing field\(s\) \['answer'\]"):
        DatasetTask(str(f), "prompt", "answer", False, eval_size=1, seed=0)


def test_bad_json_fails_with_line_or_is_skipped_and_counted(tmp_path):
    f = _write(tmp_path, ['{"prompt": "1+1=", "answer": "2"}', "{not json", '{"prompt": "3+3=", "answer": 6}',
                          '{"prompt": "4+4=", "answer": 8}'])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: not valid JSON"):
        DatasetTask(str(f), "prompt", "answer", False, eval_size=1, seed=0)
    task = DatasetTask(str(f), "prompt", "answer", True, eval_size=1, seed=0)
    assert task.counts == {"invalid": 1, "too_long": 0} and len(task.train_rows) == 2


def test_long_prompts_are_filtered_and_counted(tmp_path):
    f = _write(tmp_path, ['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "' + "9" * 50 + '", "answer": "1"}',
                          '{"prompt": "3+3=", "answer": "6"}'])
    task = DatasetTask(str(f), "prompt", "answer", False, eval_size=1, seed=0, too_long=lambda p: len(p) > 10)
    assert task.counts["too_long"] == 1 and len(task.train_rows) + len(task.eval_rows) == 2


def test_cli_bad_dataset_exits_2_before_ray(tmp_path):
    f = _write(tmp_path, ['{"prompt": "1+1=", "answer": "2"}', '{"question": "2+2="}'])
    r = cli("train", f"data.path={f}", f"run.dir={tmp_path}/run")
    assert r.returncode == 2 and "d.jsonl:2: missing field" in r.stderr
    assert "Started a local Ray instance" not in r.stderr
    assert "embedded model missing: building" not in r.stdout  # the rows are measured with its tokenizer alone


@pytest.mark.parametrize("kind", ["arith", "think", "calc", "chain"])
def test_an_embedded_models_tokenizer_is_known_before_its_weights(tmp_path, kind):
    """`load_tokenizer` answers for an embedded model that is not built yet (a dataset is checked in its tokens
    before the build) with the tokenizer the built directory loads: same class, ids, vocabulary and padding."""
    from transformers import AutoTokenizer

    from orchestrator.models.embedded_model import init_model, saved_tokenizer_of

    init_model(tmp_path / "m", kind=kind, target_accuracy=None, max_steps=0, log=lambda *a: None)
    built, early = AutoTokenizer.from_pretrained(tmp_path / "m"), saved_tokenizer_of(kind)
    texts = ["12+34=", "What is 3 + 4?", "<think>1+2</think>3", "[3*4]{12};"]
    assert type(early) is type(built) and early.get_vocab() == built.get_vocab()
    assert early(texts, padding=True)["input_ids"] == built(texts, padding=True)["input_ids"]


# --- Parquet: the same mapping, GSM8K handling and row checks as JSONL ---------------------------------------

def _parquet(tmp_path, columns: dict, name="train.parquet"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / name
    pq.write_table(pa.table(columns), f, row_group_size=2)  # several row groups: row numbers must run across them
    return f


def test_parquet_gsm8k_layout_matches_jsonl(tmp_path):
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    f = _parquet(tmp_path, {"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows],
                            "extra": list(range(len(rows)))})
    pq_task = DatasetTask(str(f), "question", "answer", False, eval_size=2, seed=0)
    jsonl_task = DatasetTask(str(SAMPLE), "question", "answer", False, eval_size=2, seed=0)
    assert [r[:2] for r in pq_task.train_rows] == [r[:2] for r in jsonl_task.train_rows]
    assert [r[:2] for r in pq_task.eval_rows] == [r[:2] for r in jsonl_task.eval_rows]
    assert pq_task.eval_set(2)[0].metadata == {"answer": "300", "extra": 3}  # every other column is metadata
    assert [p.text for p in pq_task.train_batch(5, 3)] == [p.text for p in jsonl_task.train_batch(5, 3)]


def test_parquet_custom_columns_and_numeric_answers(tmp_path):
    f = _parquet(tmp_path, {"problem": ["1+1=", "2+3=", "7*6=", "9-4="], "solution": [2, 5, 42, 5],
                            "source": ["a", "b", "c", "d"]})
    task = DatasetTask(str(f), "problem", "solution", False, eval_size=1, seed=0)
    assert [r[:2] for r in task.train_rows] == [("1+1=", "2"), ("2+3=", "5"), ("7*6=", "42")]
    assert [r[:2] for r in task.eval_rows] == [("9-4=", "5")]
    assert math_reward("9-4=", "5", task.eval_set(1)[0].metadata) == 1.0


def test_parquet_missing_column_fails_even_with_skip_invalid(tmp_path):
    f = _parquet(tmp_path, {"prompt": ["1+1=", "2+2="], "label": ["2", "4"]})
    for skip in (False, True):
        with pytest.raises(DatasetError, match=r"train\.parquet: missing column\(s\) \['answer'\] \(file has "
                                               r"\['prompt', 'label'\]"):
            DatasetTask(str(f), "prompt", "answer", skip, eval_size=1, seed=0)


def test_parquet_null_prompt_names_the_row_or_is_skipped(tmp_path):
    prompts = [f"{i}+1=" for i in range(6)]
    prompts[4] = None  # row 4 (0-based), in the third row group
    f = _parquet(tmp_path, {"prompt": prompts, "answer": [str(i + 1) for i in range(6)]})
    with pytest.raises(DatasetError, match=r"train\.parquet: row 4: field 'prompt' must be a non-empty string or a "
                                           r"list of chat messages, got null \(set data\.skip_invalid=true"):
        DatasetTask(str(f), "prompt", "answer", False, eval_size=1, seed=0)
    task = DatasetTask(str(f), "prompt", "answer", True, eval_size=1, seed=0)
    assert task.counts == {"invalid": 1, "too_long": 0} and len(task.train_rows) == 4
    assert "4+1=" not in {r[0] for r in task.train_rows + task.eval_rows}


def test_parquet_null_answer_and_long_prompts(tmp_path):
    f = _parquet(tmp_path, {"prompt": ["1+1=", "9" * 50, "3+3=", "4+4="], "answer": ["2", "1", None, "8"]})
    with pytest.raises(DatasetError, match=r"row 2: field 'answer' must be a string or a number, got null"):
        DatasetTask(str(f), "prompt", "answer", False, eval_size=1, seed=0, too_long=lambda p: len(p) > 10)
    task = DatasetTask(str(f), "prompt", "answer", True, eval_size=1, seed=0, too_long=lambda p: len(p) > 10)
    assert task.counts == {"invalid": 1, "too_long": 1} and [r[:2] for r in task.train_rows] == [("1+1=", "2")]


def test_not_a_parquet_file(tmp_path):
    f = tmp_path / "broken.parquet"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(DatasetError, match=r"broken\.parquet: not a readable Parquet file"):
        DatasetTask(str(f), "prompt", "answer", False, eval_size=1, seed=0)


def test_chat_message_prompts_are_accepted_and_bad_messages_named(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    good = _write(tmp_path, [json.dumps({"prompt": msgs, "answer": "4"})] * 3)
    task = DatasetTask(str(good), "prompt", "answer", False, eval_size=1, seed=0)
    assert task.eval_set(1)[0].text == msgs
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "robot", "content": "x"}], "answer": "4"}) + "\n")
    with pytest.raises(DatasetError, match=r"bad\.jsonl:1: field 'prompt', message 0: expected \{role: one of"):
        DatasetTask(str(bad), "prompt", "answer", False, eval_size=1, seed=0)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_rows_other_columns_reach_the_reward_functions(tmp_path, suffix):
    """Every column but the prompt is metadata, so countdown reads `numbers` and `target` from a file
    (no `answer` column needed with a verifier other than math), and `math` keeps `answer`."""
    rows = [{"prompt": f"Use {a}, {b} to make {a + b}", "numbers": [a, b], "target": a + b, "level": i}
            for i, (a, b) in enumerate([(3, 4), (5, 6), (7, 8), (9, 1)])]
    path = tmp_path / f"countdown.{suffix}"
    if suffix == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    task = DatasetTask(str(path), "prompt", "answer", False, eval_size=1, seed=0, verifier="countdown")
    p = task.eval_set(1)[0]
    assert p.metadata == {"numbers": [9, 1], "target": 10, "level": 3}
    assert countdown_reward(p.text, "9+1", p.metadata) == 1.0 and countdown_reward(p.text, "9*1", p.metadata) == 0.0
    with pytest.raises(DatasetError, match=r"missing (field|column)\(s\) \['answer'\]"):  # math needs its reference
        DatasetTask(str(path), "prompt", "answer", False, eval_size=1, seed=0)
