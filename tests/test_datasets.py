"""JSONL datasets: field mapping, the GSM8K layout, and bad rows reported with file and line."""

import subprocess
import sys
from pathlib import Path

import pytest

from rewards.datasets import DatasetError, DatasetTask, gsm8k_answer
from rewards.functions import math_reward

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
    r = subprocess.run([sys.executable, "-m", "orchestrator", "train", f"data.path={f}", f"run.dir={tmp_path}/run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "d.jsonl:2: missing field" in r.stderr
    assert "Started a local Ray instance" not in r.stderr
