"""What the model writes, kept where a person looks: every eval's greedy completions with their verdicts
(``<run.dir>/evals/step_N.jsonl``), a few of them as text in the trackers and on the console
(``trainer.show_samples``), and a cheap degeneration monitor for every step (``train/restate_frac``: the share of
completions that mostly copy the prompt), so that a policy paid for echoing the question shows in the curves
even when its reward is broken."""

from __future__ import annotations

import json
import re
from pathlib import Path

_TOKEN = re.compile(r"[A-Za-z]+|[0-9]+|[^\sA-Za-z0-9]")
_WRAPPER = re.compile(r"\\[A-Za-z]+|[{}$]")  # LaTeX commands (\boxed), braces, dollars: not content
RESTATE_NGRAM = 3
"""Token n-gram length of the overlap test."""
RESTATE_SHARE = 0.7
"""A completion restates its prompt when more than this share of its tokens lie in n-grams of the prompt."""


def restates_prompt(prompt: str, completion: str) -> bool:
    """Whether the completion mostly copies its prompt: over :data:`RESTATE_SHARE` of its tokens (words,
    numbers, single symbols; LaTeX commands, braces and ``$`` dropped) are covered by token
    :data:`RESTATE_NGRAM`-grams that also occur in the prompt.
    ``64 + 95`` or ``64 + 95 =`` for "What is 64 + 95?" restate it; ``64 + 95 = 159`` (60%) and ``159`` do not."""
    tokens, source = _TOKEN.findall(_WRAPPER.sub(" ", completion)), _TOKEN.findall(_WRAPPER.sub(" ", prompt))
    n = RESTATE_NGRAM
    if len(tokens) < n:
        return False
    grams = {tuple(source[i:i + n]) for i in range(len(source) - n + 1)}
    covered = [False] * len(tokens)
    for i in range(len(tokens) - n + 1):
        if tuple(tokens[i:i + n]) in grams:
            covered[i:i + n] = [True] * n
    return sum(covered) > RESTATE_SHARE * len(tokens)


def restate_frac(samples: list) -> float:
    """Share of ``samples`` (with ``prompt_text`` and ``completion_text``) that restate their prompt."""
    return sum(restates_prompt(s.prompt_text, s.completion_text) for s in samples) / max(len(samples), 1)


def eval_records(samples: list, correct: list[bool]) -> list[dict]:
    """One record per eval prompt: the prompt as rendered, the greedy completion, the reference and the verdict."""
    return [{"uid": s.prompt_uid, "prompt": s.prompt_text, "completion": s.completion_text,
             "answer": s.metadata.get("answer"), "correct": bool(ok),
             "restates_prompt": restates_prompt(s.prompt_text, s.completion_text)}
            for s, ok in zip(samples, correct)]


def write_eval_samples(run_dir: Path, step: int, records: list[dict]) -> Path:
    """``<run_dir>/evals/step_<step>.jsonl``, written under a temporary name and renamed (never half-written)."""
    out = Path(run_dir) / "evals" / f"step_{step}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(out)
    return out


def shown(records: list[dict], n: int) -> list[dict]:
    """The ``n`` records to show: the first wrong ones and the first right ones, about half each."""
    wrong = [r for r in records if not r["correct"]]
    right = [r for r in records if r["correct"]]
    k = min(len(wrong), max(n - len(right), (n + 1) // 2))
    return wrong[:k] + right[:n - k]


def as_text(records: list[dict]) -> str:
    """Markdown for a tracker's text panel: prompt, completion and verdict of each record."""
    return "\n\n".join(f"**{'right' if r['correct'] else 'wrong'}** (answer {r['answer']})  \n"
                       f"prompt: `{_one_line(r['prompt'])}`  \ncompletion: `{_one_line(r['completion'])}`"
                       for r in records)


def _one_line(text: str, limit: int = 300) -> str:
    text = text.replace("\n", "\\n").replace("`", "'")
    return text if len(text) <= limit else text[:limit] + "..."
