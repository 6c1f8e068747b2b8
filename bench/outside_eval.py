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
    python -m bench.outside_eval -c configs/smollm2_tools.yaml --model runs/smollm2_tools/2_tool_rl/final

With ``data.task: constitution`` a reply is scored by the principles' rule checks instead (``rules``: all of
them). With ``env.tools`` in the config (a recipe's last stage is read) each problem is a tool episode played here:
greedy turns, a ``<tool_call>{json}</tool_call>`` in a reply parsed with this file's own regex and ``json``, the
tool run (fleetrl's calculator / sandboxed python: the environment, not the judge), its output appended as a
``tool`` message through the tokenizer's own chat template, until a reply without a call (scored) or
``env.max_turns``. The tool-call and right-tool rates are reported beside the two accuracies.

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
        messages = [{"role": "user", "content": p.text}] if isinstance(p.text, str) else list(p.text)
        if system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        if tok.chat_template is None and len(messages) == 1:  # a base model (the embedded one): the plain prompt
            texts.append(messages[0]["content"])
        else:
            texts.append(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    replies = []
    for i in range(0, len(texts), batch_size):
        enc = tok(texts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        replies += tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return replies


def verdicts(task: str, reply: str, metadata: dict) -> dict[str, bool]:
    """A reply's verdicts: ``last_int`` and ``single`` for a numeric answer; for the ``constitution`` task (no
    answer: principles) ``rules``, every rule check of the prompt passed (the rules are the principles' definition,
    :mod:`rewards.constitution`; what this file adds there is generation outside fleetrl's engines)."""
    if task == "constitution":
        from rewards.constitution import constitution_reward

        return {"rules": all(v >= 1.0 for v in constitution_reward("", reply, metadata).values())}
    return {"last_int": last_int(reply, metadata["answer"]), "single": single(reply, metadata["answer"])}


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_call(reply: str) -> tuple[str, dict] | None:
    """The first ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of a reply, or None."""
    m = _CALL.search(reply)
    try:
        call = json.loads(m.group(1)) if m else None
        return (call["name"], dict(call["arguments"])) if isinstance(call, dict) else None
    except (ValueError, KeyError, TypeError):
        return None


def run_call(name: str, arguments: dict, tools: list[str]) -> str:
    from workers.envs.tools import calculate, run_python

    try:
        if name == "calculator" and name in tools:
            return calculate(str(arguments["expression"]))
        if name == "python" and name in tools:
            return run_python(str(arguments["code"]))
        return f"unknown tool {name!r}"
    except Exception as e:  # the tool's error is the observation, as in any agent loop
        return f"error: {e}"


def tool_episodes(model_dir: str, prompts: list, system_prompt: str | None, max_new_tokens: int, max_turns: int,
                  tools: list[str], batch_size: int = 16) -> list[dict]:
    """Greedy tool episodes, all conversations advanced one turn per batch round."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    eps = [{"messages": ([{"role": "system", "content": system_prompt}] if system_prompt else [])
            + [{"role": "user", "content": p.text}], "calls": [], "reply": None} for p in prompts]
    for _ in range(max_turns):
        active = [e for e in eps if e["reply"] is None]
        for i in range(0, len(active), batch_size):
            part = active[i:i + batch_size]
            texts = [tok.apply_chat_template(e["messages"], tokenize=False, add_generation_prompt=True) for e in part]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tok.pad_token_id)
            for e, reply in zip(part, tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)):
                e["messages"].append({"role": "assistant", "content": reply})
                call = parse_call(reply)
                if call is None:
                    e["reply"] = reply
                    continue
                e["calls"].append(call[0])
                e["messages"].append({"role": "tool", "name": call[0], "content": run_call(*call, tools)})
    for e in eps:
        e["reply"] = e["reply"] if e["reply"] is not None else ""  # out of turns: no answer
    return eps


def main(argv: list[str] | None = None) -> dict:
    from orchestrator.recipes.pipeline import config_or_stage
    from rewards.tasks import make_task_from_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--model", help="model directory (default: the config's model.path)")
    ap.add_argument("--n", type=int, help="held-out prompts (default: data.eval_size)")
    ap.add_argument("--out", help="JSONL of every reply with its verdicts")
    ap.add_argument("--rescore", help="an --out file: score its replies again (no generation)")
    args = ap.parse_args(argv)
    cfg = config_or_stage(args.config, [])
    import torch

    torch.set_num_threads(2)
    prompts = make_task_from_config(cfg.data).eval_set(args.n or cfg.data.eval_size)
    t0 = time.perf_counter()
    if args.rescore:
        saved = [json.loads(line) for line in Path(args.rescore).read_text().splitlines()]
        if [r["prompt"] for r in saved] != [p.text for p in prompts[:len(saved)]] or len(saved) != len(prompts):
            raise SystemExit(f"{args.rescore}: its prompts are not this config's {len(prompts)} held-out prompts")
        replies, calls = [r["reply"] for r in saved], [r.get("calls", []) for r in saved]
    elif cfg.env.name:
        eps = tool_episodes(args.model or cfg.model.path, prompts, cfg.data.system_prompt, cfg.rollout.max_new_tokens,
                            cfg.env.max_turns, cfg.env.tools)
        replies, calls = [e["reply"] for e in eps], [e["calls"] for e in eps]
    else:
        replies = generate(args.model or cfg.model.path, prompts, cfg.data.system_prompt, cfg.rollout.max_new_tokens)
        calls = [[] for _ in replies]
    rows = [{"prompt": p.text, "reply": r, "answer": p.metadata["answer"], "calls": c,
             **verdicts(cfg.data.task, r, p.metadata)} for p, r, c in zip(prompts, replies, calls)]
    n = len(rows)
    report = {"model": args.model or cfg.model.path, "n": n, "seconds": round(time.perf_counter() - t0, 1)}
    if cfg.env.name:
        called = [(r["calls"], p.metadata.get("tool")) for r, p in zip(rows, prompts) if r["calls"]]
        report["tool_call_rate"] = round(len(called) / n, 4)
        if called and all(tool for _, tool in called):
            report["right_tool_rate"] = round(sum(c[0] == tool for c, tool in called) / len(called), 4)
    for rule in verdicts(cfg.data.task, "", prompts[0].metadata):
        acc = sum(r[rule] for r in rows) / n
        report[rule] = {"accuracy": round(acc, 4), "se": round(math.sqrt(acc * (1 - acc) / n), 4)}
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
