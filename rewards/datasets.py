"""User datasets: prompts and reference answers from a JSONL file (one JSON object per line).

``data.path`` names the file; ``data.prompt_field`` and ``data.answer_field`` map its columns. The GSM8K layout
(``question``, ``answer`` ending in ``#### n``) is understood: the reference answer is ``n``. A malformed row fails
with file and line, or, with ``data.skip_invalid``, is skipped and counted. Prompts longer than
``data.max_prompt_tokens`` are filtered and counted. The eval split is ``data.eval_path`` when given, else the
last ``data.eval_size`` rows, which are then never trained on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from rewards.tasks import Prompt


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file and line."""


def read_rows(path: Path, prompt_field: str, answer_field: str, skip_invalid: bool,
              too_long: Callable[[str], bool]) -> tuple[list[tuple[str, str]], dict]:
    """(prompt, answer) pairs and counts of skipped rows."""
    if not path.is_file():
        raise DatasetError(f"data.path: {path} is not a file")
    rows, counts = [], {"invalid": 0, "too_long": 0}
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompt, answer = _parse(line, prompt_field, answer_field)
            except DatasetError as e:
                if not skip_invalid:
                    raise DatasetError(f"{path}:{lineno}: {e} (set data.skip_invalid=true to skip such rows)") from None
                counts["invalid"] += 1
                continue
            if too_long(prompt):
                counts["too_long"] += 1
                continue
            rows.append((prompt, answer))
    if not rows:
        raise DatasetError(f"{path}: no usable rows ({counts['invalid']} invalid, {counts['too_long']} too long)")
    return rows, counts


def _parse(line: str, prompt_field: str, answer_field: str) -> tuple[str, str]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"expected a JSON object, got {type(row).__name__}")
    missing = [k for k in (prompt_field, answer_field) if k not in row]
    if missing:
        raise DatasetError(f"missing field(s) {missing} (row has {sorted(row)}; see data.prompt_field, "
                           "data.answer_field)")
    prompt, answer = row[prompt_field], row[answer_field]
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"field {prompt_field!r} must be a non-empty string")
    return prompt, gsm8k_answer(str(answer))


def gsm8k_answer(answer: str) -> str:
    """GSM8K's reference solutions end in ``#### n``: keep ``n`` (thousands separators removed)."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip().replace(",", "")
    return answer.strip()


class DatasetTask:
    """Same interface as the built-in tasks: ``train_batch(step, n, round_)`` and ``eval_set(n)``."""

    def __init__(self, path: str, prompt_field: str, answer_field: str, skip_invalid: bool, eval_size: int,
                 seed: int, eval_path: str | None = None, too_long: Callable[[str], bool] = lambda p: False):
        rows, self.counts = read_rows(Path(path), prompt_field, answer_field, skip_invalid, too_long)
        if eval_path:
            self.eval_rows, _ = read_rows(Path(eval_path), prompt_field, answer_field, skip_invalid, too_long)
            self.train_rows = rows
        else:
            if len(rows) <= eval_size:
                raise DatasetError(f"{path}: {len(rows)} usable rows cannot hold out data.eval_size={eval_size} "
                                   "for evaluation and still train; lower it or give data.eval_path")
            self.train_rows, self.eval_rows = rows[:-eval_size], rows[-eval_size:]
        self.seed = seed

    @staticmethod
    def _prompt(uid: str, row: tuple[str, str]) -> Prompt:
        return Prompt(uid=uid, text=row[0], metadata={"answer": row[1]})

    def train_batch(self, step: int, n: int, round_: int = 0) -> list[Prompt]:
        rng = random.Random(f"{self.seed}:{step}" + (f":{round_}" if round_ else ""))
        idx = rng.sample(range(len(self.train_rows)), n) if n <= len(self.train_rows) else \
            [rng.randrange(len(self.train_rows)) for _ in range(n)]
        tag = f"s{step}" + (f"r{round_}" if round_ else "")
        return [self._prompt(f"{tag}-{i}", self.train_rows[j]) for i, j in enumerate(idx)]

    def eval_set(self, n: int) -> list[Prompt]:
        return [self._prompt(f"eval-{i}", row) for i, row in enumerate(self.eval_rows[:n])]
