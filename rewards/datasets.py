"""User datasets: prompts and reference answers from a JSONL file (one JSON object per line) or a Parquet file.

``data.path`` names the file (a name ending in ``.parquet`` is read with pyarrow, anything else as JSONL);
``data.prompt_field`` and ``data.answer_field`` map its columns. The GSM8K layout (``question``, ``answer`` ending
in ``#### n``) is understood: the reference answer is ``n``. A malformed row fails naming the file and where
(JSONL: ``file:line``, 1-based; Parquet: ``file: row i``, 0-based as in pandas' ``iloc``), or, with
``data.skip_invalid``, is skipped and counted; a Parquet file lacking a mapped column fails whatever
``skip_invalid`` says. Prompts longer than ``data.max_prompt_tokens`` are filtered and counted. The eval split is
``data.eval_path`` when given, else the last ``data.eval_size`` rows, which are then never trained on.
``data.verifier`` names the reward function that decides correctness for accuracy metrics (default ``math``);
``data.answer_form`` (``auto | number | expression``) tells it what form a final answer takes
(:mod:`rewards.answers`); ``number`` checks every reference answer is a numeral at load.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rewards.functions import MESSAGES_KEY, is_batched, load_reward_function
from rewards.tasks import Prompt, Task


def yaml_load(text: str):
    """``yaml.safe_load``, except that a key given twice in one mapping is an error (YAML keeps the last one
    silently), naming the key and its line."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                            key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=UniqueKeys)  # noqa: S506 - a SafeLoader subclass


def read_yaml_mapping(path: str | Path, what: str, error: type[Exception] = ValueError) -> dict:
    """A YAML file whose top level is a mapping (an empty file is ``{}``); an unreadable file, invalid YAML or
    another top level raise ``error`` naming ``what`` and the file."""
    import yaml

    try:
        tree = yaml_load(Path(path).read_text()) or {}
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise error(f"{what} {path}: not valid YAML: {e}") from e
    if not isinstance(tree, dict):
        raise error(f"{what} {path}: top level must be a mapping, got {type(tree).__name__}")
    return tree


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file and the line or row."""


def read_rows(path: Path, prompt_field: str, answer_field: str, skip_invalid: bool,  # noqa: PLR0913
              too_long: Callable[[str], bool], answer_form: str = "auto", answer_required: bool = True,
              config: str | None = None, split: str = "train") -> tuple[list[tuple[str, str | None, dict]], dict]:
    """(prompt, answer, the row's other columns) triples and counts of skipped rows (``answer_form: number``: every
    answer is a numeral; ``answer_required`` False: a row may have no answer, for verifiers that read other
    columns, e.g. countdown's ``numbers``/``target`` or code's ``tests``); ``config`` and ``split`` select the rows of
    a dataset directory (:func:`dataset_records`)."""
    fields = (prompt_field, answer_field) if answer_required else (prompt_field,)
    records, decode = dataset_records(path, fields, config, split)
    rows, counts = [], {"invalid": 0, "too_long": 0}
    for where, record in records:
        try:
            row = decode(record)
            prompt, answer = _parse_row(row, prompt_field, answer_field, answer_required)
            if answer is not None:
                _check_form(answer, answer_form, answer_field)
        except DatasetError as e:
            if not skip_invalid:
                raise DatasetError(f"{where}: {e} (set data.skip_invalid=true to skip such rows)") from None
            counts["invalid"] += 1
            continue
        if too_long(prompt):
            counts["too_long"] += 1
            continue
        rows.append((prompt, answer, {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}))
    if not rows:
        raise DatasetError(f"{path}: no usable rows ({counts['invalid']} invalid, {counts['too_long']} too long)")
    return rows, counts


def dataset_records(path: Path, fields: tuple[str, ...] = (), config: str | None = None,
                    split: str = "train") -> tuple[Iterator[tuple[str, object]], Callable[[object], dict]]:
    """``(where, record)`` of every row of a dataset and the function that makes a record a dict: a JSONL file
    (any name but those below; ``where`` is ``file:line``), a Parquet file (``fields`` must be columns), a ``.json``
    or ``.csv`` file, or a directory: one written by ``Dataset.save_to_disk`` or a dataset repo in the Hub layout
    (its README's ``configs`` or its files), read with the ``datasets`` library at ``config`` and ``split``."""
    if path.is_dir():
        return _hf_records(path, fields, config, split), dict
    if not path.is_file():
        raise DatasetError(f"{path}: no such file or dataset directory")
    if path.suffix == ".parquet":
        return _parquet_records(path, fields), dict
    if path.suffix in (".json", ".csv"):
        return _hf_records(path, fields, None, "train"), dict
    return _jsonl_records(path), json_object


def _hf_records(path: Path, fields: tuple[str, ...], config: str | None,
                split: str) -> Iterator[tuple[str, dict]]:
    """The rows of ``path`` through the ``datasets`` library (see :func:`dataset_records`)."""
    ds = _load_hf(path, config, split)
    missing = [f for f in dict.fromkeys(fields) if f not in ds.column_names]
    where = f"{path}" + (f" [{config or 'default'}/{split}]" if path.is_dir() else "")
    if missing:
        raise DatasetError(f"{where}: missing column(s) {missing} (it has {ds.column_names}; see data.prompt_field, "
                           "data.answer_field)")
    for i, row in enumerate(ds):
        yield f"{where}: row {i}", row


def _load_hf(path: Path, config: str | None, split: str):
    """A ``datasets.Dataset``; a DatasetError naming the path, config and split when it cannot be read."""
    import datasets

    datasets.disable_progress_bars()
    try:
        if path.is_file():
            return datasets.load_dataset("csv" if path.suffix == ".csv" else "json", data_files=str(path),
                                         split="train")
        if (path / "state.json").exists() or (path / "dataset_dict.json").exists():  # Dataset.save_to_disk
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict) and split not in loaded:
                raise DatasetError(f"{path}: no split {split!r} (it has {sorted(loaded)})")
            return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        return datasets.load_dataset(str(path), name=config, split=split)
    except DatasetError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types for a config, split or file it cannot use
        first = str(e).splitlines()[0] if str(e) else ""
        raise DatasetError(f"{path} (config {config!r}, split {split!r}): cannot be read as a dataset: "
                           f"{type(e).__name__}: {first[:300]}") from None


def _jsonl_records(path: Path) -> Iterator[tuple[str, str]]:
    """(``file:line``, line text) for every non-blank line; a line that is not UTF-8 is a DatasetError naming it."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at column "
                                   f"{e.start + 1})") from None
            if line.strip():
                yield f"{path}:{lineno}", line


def _parquet_records(path: Path, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(``file: row i``, {column: value}) for every row, every column, in batches (``fields``: the prompt and answer
    columns, which must exist)."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for an unreadable file
        raise DatasetError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    missing = [f for f in dict.fromkeys(fields) if f not in pf.schema_arrow.names]
    if missing:
        raise DatasetError(f"{path}: missing column(s) {missing} (file has {pf.schema_arrow.names}; see "
                           "data.prompt_field, data.answer_field)")
    i = 0
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            yield f"{path}: row {i}", row
            i += 1


def json_object(line: str) -> dict:
    """One JSONL line as a dict; DatasetError saying what it is otherwise."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"expected a JSON object, got {type(row).__name__}")
    return row


def _parse_row(row: dict, prompt_field: str, answer_field: str,
               answer_required: bool = True) -> tuple[str | list[dict], str | None]:
    """(prompt, reference answer or None) of one row, whatever the file format; raises DatasetError saying what is
    wrong."""
    missing = [k for k in (prompt_field, *([answer_field] if answer_required else [])) if k not in row]
    if missing:
        raise DatasetError(f"missing field(s) {missing} (row has {sorted(row)}; see data.prompt_field, "
                           "data.answer_field)")
    prompt, answer = row[prompt_field], row.get(answer_field)
    if isinstance(prompt, list):
        _check_messages(prompt, prompt_field)
    elif not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"field {prompt_field!r} must be a non-empty string or a list of chat messages, got "
                           f"{_short(prompt)}")
    if answer is None and not answer_required:
        return prompt, None
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetError(f"field {answer_field!r} must be a string or a number, got {_short(answer)}")
    return prompt, gsm8k_answer(str(answer))


def _check_form(answer: str, form: str, field: str) -> None:
    from rewards.answers import parse_number

    if form == "number" and parse_number(answer) is None:
        raise DatasetError(f"field {field!r}: data.answer_form=number needs a numeral (159, -3.5, 3/4), got "
                           f"{answer[:40]!r}")


def _check_messages(messages: list, field: str) -> None:
    """A chat prompt: a non-empty list of ``{"role": system|user|assistant|tool, "content": str}``."""
    roles = ("system", "user", "assistant", "tool")
    if not messages:
        raise DatasetError(f"field {field!r}: an empty list of chat messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise DatasetError(f"field {field!r}, message {i}: expected {{role: one of {list(roles)}, content: "
                               f"string}}, got {_short(m)}")


def _short(value) -> str:
    return f"{type(value).__name__} {str(value)[:40]!r}" if value is not None else "null"


def gsm8k_answer(answer: str) -> str:
    """GSM8K's reference solutions end in ``#### n``: keep ``n`` (thousands separators removed)."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip().replace(",", "")
    return answer.strip()


@dataclass(frozen=True)
class Splits:
    """Which rows: a dataset directory's ``config`` (subset), its ``train`` split, and the eval rows: an ``eval``
    split of the same dataset or a separate ``eval_path`` (neither: held out from the end of ``train``)."""

    config: str | None = None
    train: str = "train"
    eval: str | None = None
    eval_path: str | None = None


class DatasetTask(Task):
    """Same interface as the built-in tasks: ``train_batch(step, n, round_)``, ``eval_set(n)`` and ``verifier``
    (a reward function name or ``pkg.module:fn``, loaded here so that a bad one fails at once)."""

    def __init__(self, path: str, prompt_field: str, answer_field: str, skip_invalid: bool, eval_size: int,
                 seed: int, too_long: Callable[[str], bool] = lambda p: False, verifier: str = "math",
                 answer_form: str = "auto", splits: Splits | None = None):
        self.verifier, self.verifier_fn = verifier, load_reward_function(verifier)  # a bad name fails before reading
        if is_batched(self.verifier_fn):
            raise DatasetError(f"data.verifier: {verifier!r} has TRL's batched signature; the verifier decides one "
                               "completion at a time: fn(prompt, completion, metadata) (e.g. math)")
        self.answer_form = answer_form
        required = verifier == "math"  # other verifiers may read other columns (countdown: numbers, target)
        sp = splits or Splits()
        read = functools.partial(read_rows, prompt_field=prompt_field, answer_field=answer_field,
                                 skip_invalid=skip_invalid, too_long=too_long, answer_form=answer_form,
                                 answer_required=required)
        rows, self.counts = read(Path(path), config=sp.config, split=sp.train)
        if sp.eval_path or sp.eval:
            self.eval_rows, _ = read(Path(sp.eval_path or path), config=sp.config, split=sp.eval or "train")
            self.train_rows = rows
        else:
            if len(rows) <= eval_size:
                raise DatasetError(f"{path}: {len(rows)} usable rows cannot hold out data.eval_size={eval_size} "
                                   "for evaluation and still train; lower it or give data.eval_path")
            self.train_rows, self.eval_rows = rows[:-eval_size], rows[-eval_size:]
        self.seed = seed

    def _prompt(self, uid: str, row: tuple[str, str | None, dict]) -> Prompt:
        """A row as a prompt: its other columns are the metadata the reward functions get, with ``answer``."""
        form = {} if self.answer_form == "auto" else {"answer_form": self.answer_form}
        text, answer, extra = row
        conv = {MESSAGES_KEY: text} if isinstance(text, list) else {}  # what a TRL-signature reward gets as prompt
        return Prompt(uid=uid, text=text, metadata={**extra, **({"answer": answer} if answer is not None else {}),
                                                    **form, **conv})

    def draw_train(self, rng: random.Random, n: int) -> list[tuple[str, dict]]:
        idx = rng.sample(range(len(self.train_rows)), n) if n <= len(self.train_rows) else \
            [rng.randrange(len(self.train_rows)) for _ in range(n)]
        return [(p.text, p.metadata) for p in (self._prompt("", self.train_rows[j]) for j in idx)]

    def eval_set(self, n: int) -> list[Prompt]:
        return [self._prompt(f"eval-{i}", row) for i, row in enumerate(self.eval_rows[:n])]
