"""An evaluator outside fleetrl: transformers ``generate``, greedy, on a config's held-out prompts.

It shares nothing with fleetrl's verifier (``rewards/answers.py``) and none of its engines: the prompts are the
task's eval set rendered with the tokenizer's own chat template (the config's system prompt first, as fleetrl
does), and a reply is scored by two plain rules, reported side by side:

- ``last_int``: the last integer in the reply equals the reference (lm-eval's "flexible extract" for GSM8K);
  an echo of the question ("64 + 95") ends in an operand and scores 0.
- ``single``: the text after the reply's last ``=``, "equals" or " is " holds exactly one integer, and it is the
  reference ("64 + 95 = 159", "64 + 95 equals 159." and "159" pass; "158 or 159" and "64 + 95" do not).

    python -m bench.outside_eval -c configs/smollm2_arith.yaml [--model DIR] [--n 200] [--out FILE]
    python -m bench.outside_eval -c configs/smollm2_arith.yaml --rescore FILE   # score the replies of an --out file

Writes every reply with both verdicts to ``--out`` (JSONL) and prints the two accuracies with their binomial
standard errors.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

_INT = re.compile(r"-?[0-9]+")


def last_int(reply: str, answer: str) -> bool:
    numbers = _INT.findall(reply)
    return bool(numbers) and int(numbers[-1]) == int(answer)


_STATED = re.compile(r"=|\bequals\b|\sis\s")


def single(reply: str, answer: str) -> bool:
    tail = _STATED.split(reply)[-1]
    numbers = _INT.findall(tail)
    return len(numbers) == 1 and int(numbers[0]) == int(answer)


def generate(model_dir: str, prompts: list, system_prompt: str | None, max_new_tokens: int,
             batch_size: int = 16) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    texts = []
    for p in prompts:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
            [{"role": "user", "content": p.text}]
        texts.append(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    replies = []
    for i in range(0, len(texts), batch_size):
        enc = tok(texts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        replies += tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return replies


def main(argv: list[str] | None = None) -> dict:
    from orchestrator.config import load_config
    from rewards.tasks import make_task_from_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--model", help="model directory (default: the config's model.path)")
    ap.add_argument("--n", type=int, help="held-out prompts (default: data.eval_size)")
    ap.add_argument("--out", help="JSONL of every reply with its verdicts")
    ap.add_argument("--rescore", help="an --out file: score its replies again (no generation)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, [])
    import torch

    torch.set_num_threads(2)
    prompts = make_task_from_config(cfg.data).eval_set(args.n or cfg.data.eval_size)
    t0 = time.perf_counter()
    if args.rescore:
        saved = [json.loads(line) for line in Path(args.rescore).read_text().splitlines()]
        if [r["prompt"] for r in saved] != [p.text for p in prompts[:len(saved)]] or len(saved) != len(prompts):
            raise SystemExit(f"{args.rescore}: its prompts are not this config's {len(prompts)} held-out prompts")
        replies = [r["reply"] for r in saved]
    else:
        replies = generate(args.model or cfg.model.path, prompts, cfg.data.system_prompt, cfg.rollout.max_new_tokens)
    rows = [{"prompt": p.text, "reply": r, "answer": p.metadata["answer"],
             "last_int": last_int(r, p.metadata["answer"]), "single": single(r, p.metadata["answer"])}
            for p, r in zip(prompts, replies)]
    n = len(rows)
    report = {"model": args.model or cfg.model.path, "n": n, "seconds": round(time.perf_counter() - t0, 1)}
    for rule in ("last_int", "single"):
        acc = sum(r[rule] for r in rows) / n
        report[rule] = {"accuracy": round(acc, 4), "se": round(math.sqrt(acc * (1 - acc) / n), 4)}
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
