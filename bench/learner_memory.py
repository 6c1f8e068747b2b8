"""Learner memory and time per update: the naive padded path vs chunked logprobs, packing and token budgets.

    python -m bench.learner_memory [--quick] [--model DIR]

One policy update as the learner does it (forward over the micro-batches, the clipped policy loss with entropy,
backward, one AdamW step) on SmolLM2-135M-Instruct (``fleetrl init-model --from smollm2-135m-instruct``;
49 152-token vocabulary) for a batch shaped like a GRPO step with ~256-token responses: 32 samples, prompts of
40-80 tokens, responses of 64-256 tokens (mean ~190; most below the cap, as real samples are). Every variant runs
in its own process (``ru_maxrss`` is per process) on the same batch:

* ``naive``: what fleetrl did before: left|right padded, fp32 logits and log-softmax over every position of the
  micro-batch, 8 samples per micro-batch;
* ``chunked``: padded, LM head on response tokens only, 1024 tokens at a time, recomputed in backward;
* ``packed``: chunked + packed rows (no padding), 8 samples per micro-batch;
* ``packed, N-token budget``: chunked + packed + token-budget micro-batches (``learner.micro_batch_tokens``):
  4096 (long packed rows: on CPU their attention is quadratic in the row length) and 512 with 256-token logprob
  chunks (the demo config's setting).

Reported: peak RSS of the process, the memory the update adds on top of the loaded model and optimizer
(``update_peak_mb`` = peak RSS - RSS before the update), seconds per update (median of the timed repeats after
one warm-up), and the largest |logprob| difference to ``naive``. Torch only, 2 threads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from bench.common import PY, SUBPROCESS_ENV, parse_args, print_table, save_result

SMOLLM2 = ".fleetrl/models/smollm2-135m-instruct"
VARIANTS = {
    "naive": dict(packing=False, chunk_tokens=0, micro_batch_tokens=None, micro=8),
    "chunked": dict(packing=False, chunk_tokens=1024, micro_batch_tokens=None, micro=8),
    "packed": dict(packing=True, chunk_tokens=1024, micro_batch_tokens=None, micro=8),
    "packed, 4096-token budget": dict(packing=True, chunk_tokens=1024, micro_batch_tokens=4096, micro=32),
    "packed, 512-token budget": dict(packing=True, chunk_tokens=256, micro_batch_tokens=512, micro=32),
}


def _batch(vocab: int, samples: int, max_response: int, seed: int = 0):
    import torch

    from learner.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, vocab, (int(torch.randint(40, 81, (1,), generator=g)),), generator=g).tolist()
               for _ in range(samples)]
    lens = [int(torch.randint(max_response // 4, max_response + 1, (1,), generator=g)) for _ in range(samples)]
    comps = [torch.randint(100, vocab, (n,), generator=g).tolist() for n in lens]
    batch = build_batch(prompts, comps, [[0.0] * n for n in lens], pad_id=2).with_scale()
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    return batch


def measure(model_dir: str, variant: str, samples: int, max_response: int, repeats: int) -> dict:
    """One variant in this process: returns its numbers (call in a fresh process)."""
    import resource

    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    from learner.forward import HiddenStatesLM, policy_logprobs
    from learner.losses import policy_loss
    from learner.packing import Layout, micro_batches

    torch.set_num_threads(2)
    v = VARIANTS[variant]
    layout = Layout(packing=v["packing"], chunk_tokens=v["chunk_tokens"], micro_batch_tokens=v["micro_batch_tokens"])
    model = HiddenStatesLM(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = _batch(model.lm.config.vocab_size, samples, max_response)
    for p in model.parameters():  # optimizer state and gradients exist before the measured update
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=False)
    rss_before = psutil.Process().memory_info().rss / 2**20
    times, first_logp = [], None
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        logps = []
        for mb in micro_batches(batch, v["micro"], layout.micro_batch_tokens):
            logp, ent = policy_logprobs(model, mb, layout, with_entropy=True)
            loss, _ = policy_loss(logp, logp.detach(), mb.advantages, mb.response_mask, mb.scale, entropy=ent)
            loss.backward()
            logps.append(logp.detach())
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
        if first_logp is None:
            first_logp = torch.cat([x[:, : batch.response_mask.shape[1]] for x in logps])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "peak_rss_mb": round(peak), "update_peak_mb": round(peak - rss_before),
            "rss_before_mb": round(rss_before), "update_s": round(sorted(times[1:])[len(times[1:]) // 2], 2),
            "tokens": int(batch.attention_mask.sum()), "padded_tokens": int(batch.attention_mask.numel()),
            "response_tokens": int(batch.response_mask.sum()), "logp": first_logp.tolist()}


def _run_variant(model_dir: str, variant: str, samples: int, max_response: int, repeats: int) -> dict:
    import os

    code = ("import json,sys; from bench.learner_memory import measure; "
            f"print('RESULT'+json.dumps(measure({model_dir!r}, {variant!r}, {samples}, {max_response}, {repeats})))")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, env={**os.environ, **SUBPROCESS_ENV},
                         timeout=3600)
    if out.returncode:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(next(line[6:] for line in out.stdout.splitlines() if line.startswith("RESULT")))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, lambda ap: ap.add_argument("--model", default=SMOLLM2))
    samples, max_response, repeats = (8, 64, 1) if args.quick else (32, 256, 1)
    import torch

    results = [_run_variant(args.model, name, samples, max_response, repeats) for name in VARIANTS]
    base = results[0]
    ref = torch.tensor(base.pop("logp"))
    rows = []
    for r in results[1:]:
        r["max_logp_diff_vs_naive"] = float((torch.tensor(r.pop("logp")) - ref).abs().max())
    for r in results:
        rows.append([r["variant"], r["peak_rss_mb"], r["update_peak_mb"],
                     round(base["update_peak_mb"] / max(r["update_peak_mb"], 1), 2), r["update_s"],
                     round(base["update_s"] / r["update_s"], 2), r.get("max_logp_diff_vs_naive", 0.0)])
    print_table(f"learner update, {samples} samples, responses <= {max_response} tokens, {args.model}",
                ["variant", "peak RSS MB", "update peak MB", "memory x lower", "s/update", "speed-up",
                 "max |dlogp| vs naive"], rows)
    save_result("learner_memory", args.quick, {"samples": samples, "max_response": max_response,
                                               "model": args.model, "results": results})


if __name__ == "__main__":
    main(sys.argv[1:])
