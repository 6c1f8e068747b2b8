"""Learner overhead: fleetrl's DeepSpeed update against a plain torch loop on the same batch and loss.

    python -m bench.learner_overhead [--quick] [--repeats N]

The batch is the generation-heavy step's (``configs/gen_heavy.yaml``, fp32): 64 samples of 16-32 prompt tokens and
exactly 128 response tokens on the ~24 M-param bench model, random tokens and advantages. Every variant runs one
policy update on it (the clipped GRPO loss with entropy, forward, backward, one AdamW step, gradient clip 1.0) in
fresh processes; the median of ``--repeats`` timed updates after one warm-up is reported, with each rank's peak
RSS and the largest |logprob| difference of the first pass against the torch loop.

* ``torch loop``: one process, 2 torch threads, the learner's own forward (``learner.forward.policy_logprobs``,
  packed, chunked logprobs) and loss (``learner.losses.call_loss``), ``torch.optim.AdamW`` and
  ``clip_grad_norm_``, micro-batches of 32 samples: what the update costs without DeepSpeed or a second rank;
* ``fleetrl``: ``learner.worker.LearnerWorker`` ranks as fleetrl runs them (DeepSpeed, gloo, ``train``), in
  separate processes (Ray's hand-over of the batch, ~1 MB here, is not included), varying ranks x threads, the
  ZeRO stage and the ZeRO-2 knobs (``overlap_comm``, bucket sizes); the rest as ``configs/gen_heavy.yaml``.

Both cores go to the variant being measured (on 2 cores nothing else runs during a sync step's update).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench.build_models import model_path
from bench.common import PY, SUBPROCESS_ENV, parse_args, print_table, require_model, save_result
from common.net import free_port

CONFIG = "configs/gen_heavy.yaml"
FP32 = ["rollout.dtype=float32", "learner.mixed_precision=null"]
# label: (kind, ranks, threads per rank, ZeRO stage, extra zero_optimization keys)
VARIANTS = {
    "torch loop, 1 process x 2 threads": ("torch", 1, 2, None, {}),
    "fleetrl, 2 ranks x 1 thread, ZeRO-2 (default)": ("fleetrl", 2, 1, 2, {}),
    "fleetrl, 2 ranks x 1 thread, ZeRO-2, overlap_comm": ("fleetrl", 2, 1, 2, {"overlap_comm": True}),
    "fleetrl, 2 ranks x 1 thread, ZeRO-2, 20 MB buckets + overlap": (
        "fleetrl", 2, 1, 2, {"overlap_comm": True, "reduce_bucket_size": 5_000_000,
                             "allgather_bucket_size": 5_000_000}),
    "fleetrl, 2 ranks x 1 thread, ZeRO-0": ("fleetrl", 2, 1, 0, {}),
    "fleetrl, 1 rank x 2 threads, ZeRO-2": ("fleetrl", 1, 2, 2, {}),
    "fleetrl, 1 rank x 2 threads, ZeRO-0": ("fleetrl", 1, 2, 0, {}),
}


def _config(model: str, overrides: list[str]):
    from orchestrator.config import load_config

    return load_config(CONFIG, [f"model.path={model}", *FP32, *overrides])


def make_batch(vocab: int, samples: int, response: int, seed: int = 0):
    """``samples`` rows of 16-32 random prompt tokens and exactly ``response`` response tokens, random advantages."""
    import torch

    from learner.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(torch.randint(16, 33, (1,), generator=g)),), generator=g).tolist()
               for _ in range(samples)]
    comps = [torch.randint(3, vocab, (response,), generator=g).tolist() for _ in range(samples)]
    batch = build_batch(prompts, comps, [[0.0] * response for _ in range(samples)], pad_id=0).with_scale()
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    return batch


def _timed(update, repeats: int) -> tuple[list[float], object]:
    times, first = [], None
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        out = update()
        times.append(time.perf_counter() - t0)
        first = out if first is None else first
    return times[1:], first


def torch_loop(model: str, samples: int, response: int, threads: int, repeats: int) -> dict:
    """The update in one process, no DeepSpeed: returns its numbers and the first pass's logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner.algorithms import loss_kwargs
    from learner.forward import HiddenStatesLM, policy_logprobs
    from learner.losses import call_loss
    from learner.packing import micro_batches
    from orchestrator.rl.specs import learner_layout

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = _config(model, [])
    kwargs = loss_kwargs(cfg.algorithm)
    objective = kwargs.pop("objective")
    layout = learner_layout(cfg)
    lm = HiddenStatesLM(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32))
    lm.train()
    opt = torch.optim.AdamW(lm.parameters(), lr=cfg.learner.lr, betas=cfg.learner.betas, weight_decay=0.0)
    batch = make_batch(lm.lm.config.vocab_size, samples, response)

    def update():
        logps = []
        for mb in micro_batches(batch, cfg.learner.micro_batch_size, layout.micro_batch_tokens):
            logp, ent = policy_logprobs(lm, mb, layout, cfg.rollout.temperature, with_entropy=True)
            inputs = {"logp": logp, "old_logp": logp.detach(), "advantages": mb.advantages,
                      "mask": mb.response_mask, "scale": mb.scale, "entropy": ent}
            loss, _ = call_loss(objective, inputs, kwargs)
            loss.backward()
            logps.append(logp.detach())
        torch.nn.utils.clip_grad_norm_(lm.parameters(), cfg.learner.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.cat(logps)

    times, logp = _timed(update, repeats)
    return _numbers(times, [logp.tolist()])


def fleetrl_rank(model: str, samples: int, response: int, rank: int, world: int, port: int, threads: int,
                 zero: int, zero_extra: dict, repeats: int) -> dict:
    """One ``LearnerWorker`` rank of the group, as fleetrl builds it; rank 0 returns the numbers."""
    import torch

    from learner.algorithms import loss_kwargs
    from learner.worker import LearnerSpec, LearnerWorker, ds_config
    from orchestrator.rl.specs import learner_layout, learner_temperature

    cfg = _config(model, [f"learner.num_ranks={world}", f"learner.zero_stage={zero}"])
    lc = cfg.learner
    gas = cfg.micro_batches_per_rank()
    micro = (cfg.sequences_per_step // world) // gas
    dsc = ds_config(micro, gas, world, zero, lc.lr, lc.betas, lc.weight_decay, lc.warmup_steps, lc.grad_clip,
                    "float32")
    dsc["zero_optimization"].update(zero_extra)
    spec = LearnerSpec(model, "float32", dsc, loss_kwargs(cfg.algorithm), learner_temperature(cfg), 0,
                       reference=False, layout=learner_layout(cfg))
    worker = LearnerWorker(rank, world, "127.0.0.1", port, spec, threads)
    batch = make_batch(worker.hf_model.config.vocab_size, samples, response)
    shard = batch.shards(world)[rank]
    logp = worker.compute_logprobs(shard, micro)["old_logprobs"]  # the weights before any update
    times, _ = _timed(lambda: worker.train([shard], 1, micro), repeats)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, {"logp": logp.tolist(), "peak": _peak_mb()})
    return _numbers(times, [g["logp"] for g in gathered], [g["peak"] for g in gathered])


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _numbers(times: list[float], logps: list, peaks: list[float] | None = None) -> dict:
    return {"update_s": round(sorted(times)[len(times) // 2], 3), "update_times_s": [round(t, 3) for t in times],
            "peak_rss_mb": [round(p) for p in (peaks or [_peak_mb()])], "logp": [r for part in logps for r in part]}


def run_variant(label: str, model: str, samples: int, response: int, repeats: int) -> dict:
    kind, world, threads, zero, extra = VARIANTS[label]
    env = {**os.environ, **SUBPROCESS_ENV, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads)}
    if kind == "torch":
        calls = [f"torch_loop({model!r}, {samples}, {response}, {threads}, {repeats})"]
    else:
        port = free_port()
        calls = [f"fleetrl_rank({model!r}, {samples}, {response}, {r}, {world}, {port}, {threads}, {zero}, "
                 f"{extra!r}, {repeats})" for r in range(world)]
    procs = [subprocess.Popen([PY, "-c", f"import json; from bench.learner_overhead import *; "
                                         f"print('RESULT' + json.dumps({call}))"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for call in calls]
    outs = [p.communicate(timeout=3600) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{label} failed:\n" + "\n".join(err[-3000:] for _, err in outs))
    result = json.loads(next(line[6:] for line in outs[0][0].splitlines() if line.startswith("RESULT")))
    return {"variant": label, "ranks": world, "threads_per_rank": threads, "zero_stage": zero,
            "zero_extra": extra, **result}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, lambda ap: ap.add_argument("--repeats", type=int, default=3))
    import torch

    model = str(model_path("gen-tiny" if args.quick else "gen-heavy"))
    require_model(model, "gen-tiny" if args.quick else "gen-heavy")
    samples, response = (16, 32) if args.quick else (64, 128)
    results = [run_variant(label, model, samples, response, args.repeats) for label in VARIANTS]
    base = results[0]
    ref = torch.tensor(base["logp"])
    rows = []
    for r in results:
        r["max_logp_diff_vs_torch"] = float((torch.tensor(r.pop("logp")) - ref).abs().max())
        rows.append([r["variant"], r["update_s"], round(r["update_s"] / base["update_s"], 2),
                     "+".join(str(p) for p in r["peak_rss_mb"]), f"{r['max_logp_diff_vs_torch']:.1e}"])
    print_table(f"one policy update, {samples} samples x {response} response tokens, {model}, fp32",
                ["variant", "s/update", "x torch loop", "peak RSS MB per rank", "max |dlogp| vs torch"], rows)
    save_result("learner_overhead", args.quick, {"samples": samples, "response": response, "model": model,
                                                 "repeats": args.repeats, "results": results})


if __name__ == "__main__":
    main(sys.argv[1:])
