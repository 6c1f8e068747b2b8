"""Supervised and preference data: rows checked one by one, rendered to the learner's token layout.

A data key (``sft.data``, ``algorithm.pairs``) names a JSONL file, a ``.json``, ``.parquet`` or ``.csv`` file, a
dataset directory (Hub layout or ``save_to_disk``; its ``train`` split) or a Hub dataset id (resolved to its
snapshot at load). TRL's formats are read as they are. SFT rows: ``{"messages": [...]}`` (conversational; roles
system, user, assistant, tool; at least one assistant turn), ``{"prompt", "completion"}`` (prompt-completion:
strings, or a message list and the assistant message(s)) or fleetrl's ``{"prompt", "response"}``. Preference rows:
``{"prompt", "chosen", "rejected"}``, each a string or a message list (the chosen/rejected list is the assistant's
turn(s) after the prompt), or without ``prompt`` (TRL's implicit prompt: chosen and rejected are whole
conversations, the prompt is the messages they share).

Rendering follows the RL prompts exactly (:class:`workers.prompts.PromptRenderer`: the tokenizer's chat template,
or the raw text for the embedded model), so what SFT teaches is what the engines are later prompted with. Only
assistant tokens are trained: the prompt is the left part of the row, and inside the completion every system or
user message, and the template's glue around turns, has loss mask 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from rewards.datasets import DatasetError, json_object
from workers.prompts import PromptRenderer

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Example:
    """One trained sequence: prompt ids (never trained), completion ids and their loss mask."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]


def write_jsonl(out: str | Path, rows: list[dict]) -> Path:
    """JSONL written under a temporary name and renamed into place: a crash or an error leaves no half file."""
    import json

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out)
    return out


def read_jsonl(path: str | Path, what: str) -> list[tuple[int, dict]]:
    """``(line number, object)`` of every non-empty line; an unreadable file or a line that is not a JSON object is
    an error naming the file and line."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise DatasetError(f"{what} {path}: cannot read it ({e.strerror})") from e
    except UnicodeDecodeError as e:
        line = Path(path).read_bytes()[: e.start].count(b"\n") + 1
        raise DatasetError(f"{what} {path}:{line}: not UTF-8 text") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((n, json_object(line)))
        except DatasetError as e:
            raise DatasetError(f"{path}:{n}: {e}") from None
    if not rows:
        raise DatasetError(f"{what} {path} has no rows")
    return rows


def read_rows(path: str | Path, what: str) -> list[tuple[str, dict]]:
    """``(where, row)`` of every row of a data key's source (see the module doc): ``where`` is ``file:line`` for
    JSONL, ``file: row i`` else; an unreadable source or a bad row is a DatasetError naming it."""
    from rewards.datasets import dataset_records

    p = Path(path)
    if p.is_file() and p.suffix not in (".parquet", ".json", ".csv"):
        return [(f"{path}:{n}", row) for n, row in read_jsonl(path, what)]
    if not p.exists():
        raise DatasetError(f"{what} {path}: no such file or dataset directory")
    records, decode = dataset_records(p)
    rows = [(where, decode(record)) for where, record in records]
    if not rows:
        raise DatasetError(f"{what} {path} has no rows")
    return rows


def _check_messages(messages, where: str, need_assistant: bool) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: messages must be a non-empty list of {{role, content}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: message {i} must be {{'role': one of {list(ROLES)}, 'content': str}}, "
                               f"got {m!r:.120}")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DatasetError(f"{where}: messages have no assistant turn (nothing to train on)")
    return messages


def _check_tools(tools, where: str) -> list[str] | None:
    """A row's ``tools``: None, or names of tools (built-in or ``package.module:tool``) that load."""
    if tools is None:
        return None
    from workers.envs.tools import load_tool

    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        raise DatasetError(f"{where}: 'tools' must be a list of tool names, got {tools!r:.120}")
    for t in tools:
        try:
            load_tool(t)
        except (KeyError, ValueError) as e:
            raise DatasetError(f"{where}: 'tools': {e.args[0]}") from None
    return tools


def _text_or_messages(value, where: str, key: str, need_assistant: bool = False):
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: {key!r} is empty")
        return value
    return _check_messages(value, f"{where} ({key})", need_assistant)


def load_sft_rows(path: str | Path) -> list[dict]:
    """SFT rows as ``{"messages": [...]}`` (a prompt/response row becomes prompt + one assistant turn)."""
    out = []
    for where, row in read_rows(path, "SFT data"):
        if "messages" in row:
            out.append({"messages": _check_messages(row["messages"], where, need_assistant=True),
                        "tools": _check_tools(row.get("tools"), where)})
        elif "prompt" in row and ("response" in row or "completion" in row):
            key = "response" if "response" in row else "completion"
            prompt = _text_or_messages(row["prompt"], where, "prompt")
            response = _text_or_messages(row[key], where, key, need_assistant=not isinstance(row[key], str))
            if key == "response" and not isinstance(response, str):
                raise DatasetError(f"{where}: 'response' must be a string (use 'messages' for several turns)")
            head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            tail = [{"role": "assistant", "content": response}] if isinstance(response, str) else response
            out.append({"messages": [*head, *tail]})
        else:
            raise DatasetError(f"{where}: a row needs 'messages', or 'prompt' and 'completion' (or 'response'); it "
                               f"has {sorted(row)}")
    return out


def load_pairs(path: str | Path) -> list[dict]:
    """Preference rows ``{"prompt", "chosen", "rejected"}`` and an optional soft label ``"preference"`` (the
    probability that ``chosen`` is the better one, in [0, 1]; default 1), each checked."""
    out = []
    for where, row in read_rows(path, "preference pairs"):
        if "prompt" not in row and "chosen" in row and "rejected" in row:
            row = _implicit_prompt(row, where)
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
        if missing:
            raise DatasetError(f"{where}: a preference row needs 'prompt', 'chosen' and 'rejected'; missing {missing}")
        pref = row.get("preference", 1.0)
        if isinstance(pref, bool) or not isinstance(pref, int | float) or not 0.0 <= pref <= 1.0:
            raise DatasetError(f"{where}: 'preference' (P(chosen is better)) must be a number in [0, 1], got "
                               f"{pref!r}")
        out.append({**{k: _text_or_messages(row[k], where, k, need_assistant=k != "prompt" and
                                            not isinstance(row[k], str)) for k in ("prompt", "chosen", "rejected")},
                    "preference": float(pref)})
    return out


def _implicit_prompt(row: dict, where: str) -> dict:
    """TRL's implicit-prompt preference row (``chosen`` and ``rejected`` whole conversations) as an explicit one:
    the prompt is the messages both share, the sides what follows (which must start with an assistant turn)."""
    chosen, rejected = row["chosen"], row["rejected"]
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise DatasetError(f"{where}: a preference row without 'prompt' needs 'chosen' and 'rejected' as message "
                           "lists that share the prompt's messages (TRL's implicit prompt)")
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n > 0 and isinstance(chosen[n - 1], dict) and chosen[n - 1].get("role") == "assistant":
        n -= 1  # the prompt ends before the answer's first assistant turn
    sides = (chosen[n:n + 1], rejected[n:n + 1])
    if n == 0 or not all(side and isinstance(side[0], dict) and side[0].get("role") == "assistant"
                         for side in sides):
        raise DatasetError(f"{where}: 'chosen' and 'rejected' share no prompt messages followed by an assistant "
                           "turn on each side (TRL's implicit prompt)")
    return {**row, "prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def draw(n_rows: int, step: int, k: int, seed: int) -> list[int]:
    """Row indices of ``step``'s ``k`` examples: consecutive slices of per-epoch seeded shuffles, a pure function
    of (seed, step), so a resumed run sees what the uninterrupted one would."""
    orders: dict[int, list[int]] = {}  # each epoch the step touches, shuffled once

    def order(epoch: int) -> list[int]:
        if epoch not in orders:
            orders[epoch] = list(range(n_rows))
            random.Random(f"{seed}:epoch{epoch}").shuffle(orders[epoch])
        return orders[epoch]

    return [order(g // n_rows)[g % n_rows] for g in range(step * k, (step + 1) * k)]


class ExampleRenderer:
    """Rows to :class:`Example` with the run's prompt rendering (``data.prompt_format``, ``data.system_prompt``)."""

    def __init__(self, tokenizer, prompt_format: str = "auto", system_prompt: str | None = None,
                 template_kwargs: dict | None = None):
        self.prompts = PromptRenderer(tokenizer, prompt_format, system_prompt, template_kwargs)
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs or {}
        self.eos = tokenizer.eos_token_id

    def sft(self, messages: list[dict], tools: list[str] | None = None) -> Example:
        """Prompt = the messages before the first assistant turn; completion = the rest, assistant tokens trained
        (tool results, the prompt and the template's glue masked). ``tools``: the names of the tools the
        conversation offers (``env.tools``), rendered by the chat template as a tool episode renders them."""
        from workers.envs.tools import load_tool

        schemas = [load_tool(t).schema() for t in tools] if tools else None
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        head = messages[:first]
        prompt = head[-1]["content"] if not self.prompts.chat and _single_user(head) else head
        if not self.prompts.chat and not (_single_user(head) and len(messages) == first + 1):
            raise DatasetError("a multi-turn (or system) row needs a chat template: this tokenizer has none "
                               "(data.prompt_format raw); give prompt/response rows")
        prompt_ids = self.prompts.render(prompt, schemas)[1]
        if not self.prompts.chat:
            return self._example(prompt_ids, [(messages[first]["content"], True)])
        return self._example(prompt_ids, self._chat_segments(self.prompts.messages(head), messages[first:], schemas))

    def completion(self, prompt, response) -> Example:
        """A preference side: the prompt (string or messages) and a response (string or assistant messages)."""
        head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        tail = [{"role": "assistant", "content": response}] if isinstance(response, str) else list(response)
        return self.sft([*head, *tail])

    def _chat_segments(self, head: list[dict], rest: list[dict], tools: list[dict] | None) -> list[tuple[str, bool]]:
        """The text the template adds for each message after ``head`` (and the generation prompt before each
        assistant turn), with whether it is trained."""
        def render(msgs, gen):
            return self.tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False,
                                                      **self.template_kwargs)

        segments, convo = [], list(head)
        for m in rest:
            before = render(convo, m["role"] == "assistant")
            if segments or m["role"] != "assistant":  # glue before a later assistant turn
                glue_from = render(convo, False)
                if not before.startswith(glue_from):
                    raise DatasetError("the chat template is not prefix-preserving; cannot mask turns exactly")
                if before != glue_from:
                    segments.append((before[len(glue_from):], False))
            convo.append(m)
            after = render(convo, False)
            if not after.startswith(before):
                raise DatasetError("the chat template is not prefix-preserving; cannot mask turns exactly")
            segments.append((after[len(before):], m["role"] == "assistant"))
        return segments

    def _example(self, prompt_ids: list[int], segments: list[tuple[str, bool]]) -> Example:
        ids, mask = [], []
        for text, trained in segments:
            seg = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if trained:
                if self.eos in seg:  # the turn ends at the end-of-turn token; the glue after it is not trained
                    cut = seg.index(self.eos) + 1
                    ids += seg[:cut]
                    mask += [1] * cut
                    ids += seg[cut:]
                    mask += [0] * (len(seg) - cut)
                    continue
                if not self.prompts.chat:
                    seg = seg + [self.eos]
            ids += seg
            mask += [int(trained)] * len(seg)
        return Example(prompt_ids, ids, mask)


def _single_user(head: list[dict]) -> bool:
    return len(head) == 1 and head[0]["role"] == "user"


def examples_batch(examples: list[Example], size: int, pad_id: int, rows_per_unit: int = 1):
    """The examples as a learner batch of exactly ``size`` rows (the learner group's batch; DeepSpeed's geometry
    is fixed). Rows past the examples repeat them with an all-zero loss mask: they add no token to the loss nor
    to its token count, so the update equals the one on the examples alone, and every row stays a real sequence.
    ``rows_per_unit=2``: the examples are (chosen, rejected) pairs, kept together."""
    from learner.batch import build_batch

    if not 1 <= len(examples) <= size or len(examples) % rows_per_unit or size % rows_per_unit:
        raise ValueError(f"examples_batch: {len(examples)} examples do not fit {size} rows of {rows_per_unit}-row "
                         "units")
    rows = [examples[i % len(examples)] for i in range(size)]
    batch = build_batch([e.prompt_ids for e in rows], [e.completion_ids for e in rows],
                        [[0.0] * len(e.completion_ids) for e in rows], pad_id, [e.loss_mask for e in rows])
    batch.response_mask[len(examples):] = 0.0
    batch.rows_per_unit = rows_per_unit
    return batch


def sample_example(sample) -> Example:
    """A generated sample as a trained example: its exact ids, its loss mask (all ones for a single turn)."""
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * len(sample.completion_ids)
    return Example(sample.prompt_ids, sample.completion_ids, mask)
