"""The embedded default model: a tiny Qwen2-architecture causal LM with its own character tokenizer,
given a short supervised warm start on the arithmetic task so that its greedy accuracy is weak but not zero.

Deterministic from a seed; written as an ordinary HF directory (config, safetensors, tokenizer.json) that
transformers and vLLM both load. Nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

CHARS = list("0123456789+-*=() ")
TOOL_CHARS = CHARS + list("[]{}")
"""The calculator model's characters: a tool call is ``[expression]``, its observation ``{result}``."""
STEP_CHARS = CHARS + [";"]
"""The step model's characters: a ``chain`` solution's steps end with ``;``."""
SPECIALS = ["<pad>", "<eos>", "<bos>"]
THINK_WORDS = ["<think>", "</think>"]
"""The reasoning model's extra tokens (one token each): DeepSeek-R1's ``<think>...</think>`` tags."""


def build_tokenizer(chars: list[str] = CHARS, words: list[str] = ()):
    """Character-level tokenizer (tokenizers library) wrapped as a transformers fast tokenizer; ``words`` are
    whole-word tokens matched before the character split (``<think>``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars + list(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_tokens([AddedToken(w, normalized=False) for w in words])
    tok.decoder = decoders.Fuse()
    tok.enable_padding(direction="left", pad_id=vocab["<pad>"], pad_token="<pad>")  # as saved after a padded call
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    fast.padding_side = "left"
    return fast


def tokenizer_of(kind: str):
    """The tokenizer an embedded model of ``kind`` is built with (and saves): known before its weights are."""
    return build_tokenizer(KINDS[kind]()[0], THINK_WORDS if kind == "think" else ())


def saved_tokenizer_of(kind: str):
    """The tokenizer a run loads from an embedded model of ``kind`` once it is built, without building it: saved
    beside a Qwen2 config.json, as the model directory holds it, and loaded back (transformers chooses the class
    from config.json)."""
    import tempfile

    from transformers import AutoTokenizer, Qwen2Config

    tokenizer = tokenizer_of(kind)
    with tempfile.TemporaryDirectory() as d:
        tokenizer.save_pretrained(d)
        Qwen2Config(vocab_size=len(tokenizer)).save_pretrained(d)
        return AutoTokenizer.from_pretrained(d)


def build_model(vocab_size: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(cfg)


def _encode_pairs(tokenizer, pairs: list[tuple[str, str | list[tuple[str, bool]]]]):
    """Right-padded ids with loss only on the completion and its EOS. A completion is a string, or segments
    ``(text, trainable)`` (a tool demonstration: the observation the environment would append is not trained)."""
    rows, comps, trained = [], [], []
    for prompt, completion in pairs:
        segments = [(completion, True)] if isinstance(completion, str) else completion
        ids, mask = [], []
        for text, trainable in segments:
            seg = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += seg
            mask += [trainable] * len(seg)
        rows.append(tokenizer(prompt)["input_ids"])
        comps.append(ids + [tokenizer.eos_token_id])
        trained.append(mask + [True])
    width = max(len(r) + len(c) for r, c in zip(rows, comps))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, c, m) in enumerate(zip(rows, comps, trained)):
        seq = r + c
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(r): len(seq)] = torch.where(torch.tensor(m), torch.tensor(c), -100)
        attn[i, : len(seq)] = 1
    return ids, labels, attn


@torch.no_grad()
def greedy_accuracy(model, tokenizer, prompts: list[str], answers: list[str], max_new_tokens: int = 5) -> float:
    """Greedy accuracy by repeated full forwards (warm start only; training uses vLLM)."""
    model.eval()
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    ids, attn = enc["input_ids"], enc["attention_mask"]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        nxt = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1].argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                if t == tokenizer.eos_token_id:
                    done[i] = True
                else:
                    out[i].append(t)
        ids = torch.cat([ids, nxt[:, None]], 1)
        attn = torch.cat([attn, torch.ones_like(nxt)[:, None]], 1)
    model.train()
    texts = [tokenizer.decode(o) for o in out]
    return sum(t.strip() == a for t, a in zip(texts, answers)) / len(prompts)


def init_model(out_dir: str | Path, seed: int = 0, target_accuracy: float | None = 0.2, max_steps: int = 2000,
               lr: float = 1e-3, batch_size: int = 256, log=print, kind: str = "arith") -> dict:
    """Build, then warm-start (AdamW, linear warmup then constant LR) until the held-out greedy accuracy,
    checked every 25 steps, reaches ``target_accuracy`` (None: run ``max_steps``); save. Returns a summary.
    ``kind``: ``arith`` (the default model, addition), ``calc`` (the tool model: multiplication, a minority of
    demonstrations calling the calculator, see :data:`KINDS`), ``think`` (the R1 recipes' base: the addition
    warm start of ``arith``, with ``<think>`` and ``</think>`` in its vocabulary, never seen in training) or
    ``chain`` (the step model: chained addition written as running totals, ``12+30+7+21=`` -> ``42;49;70``;
    greedy accuracy counts the whole reference solution)."""
    if kind not in KINDS:
        raise ValueError(f"embedded model kind {kind!r}; valid: {sorted(KINDS)}")
    chars, examples, evals = KINDS[kind]()
    targets = [getattr(task_of(kind), "solution", lambda m: m["answer"])(p.metadata) for p in evals]
    torch.set_num_threads(2)
    out_dir = Path(out_dir)
    tokenizer = tokenizer_of(kind)
    model = build_model(len(tokenizer), seed)
    ev_prompts, ev_answers = [p.text for p in evals], targets
    new_tokens = max(len(t) for t in targets) + 1
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    rng = random.Random(seed)
    t0, acc, step = time.time(), greedy_accuracy(model, tokenizer, ev_prompts, ev_answers, new_tokens), 0
    log(f"init-model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, step 0 acc {acc:.3f}")
    while (target_accuracy is None or acc < target_accuracy) and step < max_steps:
        ids, labels, attn = _encode_pairs(tokenizer, examples(rng, batch_size))
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % 25 == 0 and (target_accuracy is not None or step == max_steps):
            acc = greedy_accuracy(model, tokenizer, ev_prompts, ev_answers, new_tokens)
            if step % 100 == 0 or (target_accuracy is not None and acc >= target_accuracy):
                log(f"init-model: step {step} loss {loss.item():.3f} greedy eval acc {acc:.3f}")
        elif step % 100 == 0:
            log(f"init-model: step {step} loss {loss.item():.3f}")
    model.eval()
    import os

    final, out_dir = out_dir, out_dir.with_name(f"{out_dir.name}.building-{os.getpid()}")
    out_dir.mkdir(parents=True, exist_ok=True)  # renamed into place when complete: no half-written model directory

    from transformers.utils import logging as hf_logging

    # save_pretrained imports DeepSpeed when it is installed: without a GPU it would warn about picking the CPU
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    hf_logging.disable_progress_bar()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    summary = {"kind": kind, "steps": step, "greedy_eval_accuracy": acc, "seconds": round(time.time() - t0, 1),
               "seed": seed}
    (out_dir / "fleetrl_init.json").write_text(json.dumps(summary, indent=1))
    _move_into_place(out_dir, final)
    return summary


def _move_into_place(built: Path, final: Path) -> None:
    """``built`` becomes ``final``, replacing what was there (``init-model --force``)."""
    import os
    import shutil

    old = final.with_name(f"{final.name}.old-{os.getpid()}") if final.exists() else None
    if old is not None:
        final.rename(old)
    built.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _arith():
    task = task_of("arith")
    return CHARS, task.sft_examples, task.eval_set(200)


CHAIN_SETTINGS = {"max_operand": 9, "terms": 4}
"""The step model's task (``configs/chain.yaml`` uses the same): four numbers in [0, 9], three steps."""


def _chain():
    task = task_of("chain")
    return STEP_CHARS, task.sft_examples, task.eval_set(200)


def task_of(kind: str):
    """The task a kind's warm start trains on."""
    from rewards.tasks import ArithmeticTask, ChainTask, MultiplyTask

    if kind == "chain":
        return ChainTask(**CHAIN_SETTINGS)
    return MultiplyTask() if kind == "calc" else ArithmeticTask()


CALC_TOOL_FRACTION = 0.2
"""Share of the calculator model's warm-start demonstrations that call the tool (the rest answer directly)."""


def _calc():
    task = task_of("calc")
    return TOOL_CHARS, lambda rng, n: task.sft_examples(rng, n, CALC_TOOL_FRACTION), task.eval_set(200)


KINDS = {"arith": _arith, "calc": _calc, "think": _arith, "chain": _chain}
"""Embedded model kind -> (its characters, warm-start examples ``(rng, n)``, held-out prompts)."""
