"""The learner's update with and without LoRA at a real model's shape, torch only (no Ray, vLLM or DeepSpeed): what
runs on a lent GPU. A randomly initialized Qwen2 of Qwen2.5-0.5B's shape (151,936-token vocabulary, 24 layers,
hidden 896) in bf16; one micro-batch of packed sequences; fleetrl's own forward (``learner.forward.policy_logprobs``:
packed, chunked LM head and entropy), the clipped policy loss, backward and an AdamW step over the trainable
parameters: every parameter (full fine-tuning), or PEFT LoRA adapters on every linear layer.

    python -m bench.lora_learner [--quick] [--rows 8] [--tokens 2048] [--ranks 0 8 32 128]

Prints, per variant, seconds per update (median of 3 after a warm-up), peak accelerator memory (CUDA) or peak
RSS (CPU), and bytes per token. ``--quick``: a tiny model on the CPU, to check the script.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch


def build(quick: bool, rank: int, device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.forward import HiddenStatesLM
    from learner.lora import add_adapters

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) if quick else \
        dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2)
    torch.manual_seed(0)
    cfg = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=32768)
    dtype = torch.float32 if quick else torch.bfloat16
    lm = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)
    if rank:
        add_adapters(lm, {"rank": rank, "alpha": 2 * rank, "dropout": 0.0, "target_modules": "all-linear"})
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = HiddenStatesLM(lm).train()
    return model, cfg.vocab_size


def batch(vocab: int, rows: int, tokens: int):
    from learner.batch import build_batch

    g = torch.Generator().manual_seed(0)
    prompt = tokens // 4
    prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(rows)]
    comps = [torch.randint(3, vocab, (tokens - prompt,), generator=g).tolist() for _ in range(rows)]
    b = build_batch(prompts, comps, [[0.0] * (tokens - prompt) for _ in range(rows)], pad_id=0).with_scale()
    b.advantages = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    return b


def update(model, opt, mb, device):
    from learner.forward import policy_logprobs
    from learner.losses import call_loss
    from learner.packing import Layout

    logp, ent = policy_logprobs(model, mb, Layout(packing=True, chunk_tokens=1024, entropy=True), 1.0, True, device)
    mbd = mb.to(device)
    inputs = {"logp": logp, "old_logp": logp.detach(), "advantages": mbd.advantages, "mask": mbd.response_mask,
              "scale": mbd.scale, "ref_logp": None, "entropy": ent, "rollout_logp": mbd.rollout_logprobs,
              "targets": None}
    loss, _ = call_loss("policy", inputs, {})
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(quick: bool, rank: int, rows: int, tokens: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, vocab = build(quick, rank, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    mb = batch(vocab, rows, tokens)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(4):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        update(model, opt, mb, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"rank": rank, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "trainable_params": sum(p.numel() for p in trainable), "update_s": round(statistics.median(times[1:]), 3),
           "peak_mb": round(peak / 2**20), "peak_bytes_per_token": round(peak / (rows * tokens)),
           "rows": rows, "tokens_per_row": tokens}
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ranks", type=int, nargs="+", default=[0, 8, 32, 128])
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    rows, tokens = (2, 64) if args.quick else (args.rows, args.tokens)
    results = []
    for rank in args.ranks:
        r = measure(args.quick, rank, rows, tokens)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
