"""Generation throughput: a fleetrl rollout worker (vLLM) vs HF ``generate`` on identical work.

    python -m bench.generation [--quick] [--threads N]

Same model (``bench-gen-heavy``, ~24 M params; ``--quick``: ``bench-gen-tiny``), same prompts (arithmetic
training prompts), same G, completion length and sampling (temperature 1, top-p 1, no top-k), and the same
number of CPU threads. The models never sample EOS (see :mod:`bench.build_models`), so every completion has
exactly the requested length in both systems; the table reports the measured mean length.

Each system runs in its own process (``--system``), by precision: fp32 (HF; vLLM eager, fleetrl's CPU default)
and bf16 (HF with a bf16 model; vLLM bf16 compiled with torch.compile, as ``configs/gen_heavy.yaml`` runs it).
The worker is :class:`workers.rollout.RolloutWorker` itself (its ``generate`` also returns per-token logprobs,
which HF ``generate`` does not compute here). One untimed warm-up call each, then ``reps`` timed calls; the
median is reported. Engine start-up (and compilation) is not timed.
"""

from __future__ import annotations

import os
import sys


def _threads_from_argv(default: int = 2) -> int:
    """The thread count must be in the environment before torch is imported."""
    argv = sys.argv
    return int(argv[argv.index("--threads") + 1]) if "--threads" in argv else default


THREADS = _threads_from_argv()
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
# in-process engine; no Ray instance started as a side effect of Ray API calls outside an actor
os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "RAY_ENABLE_AUTO_CONNECT": "0"})

import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from bench.build_models import model_path, params_of  # noqa: E402
from bench.common import median, parse_args, print_table, require_model, save_result  # noqa: E402

FULL = dict(model="gen-heavy", prompts=8, group_size=8, max_tokens=128, reps=3)
QUICK = dict(model="gen-tiny", prompts=4, group_size=4, max_tokens=32, reps=1)
# system -> (label, dtype, vLLM eager); HF rows first: the ratios are against "hf-fp32"
SYSTEMS = {
    "hf-fp32": ("HF generate, fp32", "float32", None),
    "hf-bf16": ("HF generate, bf16", "bfloat16", None),
    "vllm-fp32": ("fleetrl RolloutWorker (vLLM), fp32 eager", "float32", True),
    "vllm-bf16": ("fleetrl RolloutWorker (vLLM), bf16 compiled", "bfloat16", False),
}


def hf_generate(model, tok, prompts: list[str], group_size: int, max_tokens: int, seed: int) -> list[int]:
    """Completion lengths (tokens up to and including EOS) of one batched ``generate`` call."""
    import torch

    enc = tok([p for p in prompts for _ in range(group_size)], return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_tokens,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    lengths = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        lengths.append(row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row))
    return lengths


def timed(fn, reps: int) -> tuple[float, list[int]]:
    """Median seconds of ``reps`` calls after one warm-up call; the lengths of the last call."""
    fn(0)
    seconds, lengths = [], []
    for r in range(reps):
        t0 = time.perf_counter()
        lengths = fn(r + 1)
        seconds.append(time.perf_counter() - t0)
    return median(seconds), lengths


def measure(system: str, s: dict) -> dict:
    """Time one system in this process; returns seconds and completion lengths."""
    import torch

    from rewards.tasks import ArithmeticTask

    _, dtype, eager = SYSTEMS[system]
    path = str(model_path(s["model"]))
    torch.set_num_threads(THREADS)
    prompts = ArithmeticTask().train_batch(0, s["prompts"])
    G, L = s["group_size"], s["max_tokens"]
    if system.startswith("hf"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        sec, lens = timed(lambda r: hf_generate(model, tok, [p.text for p in prompts], G, L, seed=r), s["reps"])
    else:
        from workers.rollout import EngineSpec, RolloutWorker

        worker = RolloutWorker(EngineSpec(path, dtype, max_model_len=L + 32, kv_cache_gib=0.25, seed=0,
                                          enforce_eager=eager))
        triples = [(p.uid, p.text, p.metadata) for p in prompts]
        sec, lens = timed(lambda r: [len(x.completion_ids) for x in worker.generate(
            triples, G, L, temperature=1.0, top_p=1.0, seed=r)], s["reps"])
    return {"seconds": sec, "tokens": sum(lens), "tokens_per_s": sum(lens) / sec, "mean_len": sum(lens) / len(lens)}


def main(argv: list[str] | None = None) -> int:
    def extra(ap):
        ap.add_argument("--threads", type=int, default=2, help="CPU threads for every system (default 2: all)")
        ap.add_argument("--system", choices=list(SYSTEMS), help="(internal) time one system, print JSON")

    args = parse_args(__doc__, argv, extra)
    s = QUICK if args.quick else FULL
    if args.system:
        print("RESULT " + json.dumps(measure(args.system, s)), flush=True)
        return 0
    require_model(str(model_path(s["model"])), s["model"])
    data = {"settings": {**s, "threads": THREADS, "params": params_of(s["model"]),
                         "model_path": str(model_path(s["model"]))}}
    for system in SYSTEMS:
        cmd = [sys.executable, "-m", "bench.generation", "--system", system, "--threads", str(THREADS),
               *(["--quick"] if args.quick else [])]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not lines:
            raise RuntimeError(f"{system} failed:\n{(out.stdout + out.stderr)[-3000:]}")
        data[system] = {"label": SYSTEMS[system][0], **json.loads(lines[-1][7:])}
    base = data["hf-fp32"]["tokens_per_s"]
    data["speedup"] = {"fp32_vs_hf_fp32": data["vllm-fp32"]["tokens_per_s"] / base,
                       "bf16_vs_hf_bf16": data["vllm-bf16"]["tokens_per_s"] / data["hf-bf16"]["tokens_per_s"],
                       "bf16_vs_hf_fp32": data["vllm-bf16"]["tokens_per_s"] / base}
    rows = [[data[k]["label"], s["prompts"] * s["group_size"], data[k]["mean_len"], data[k]["seconds"],
             data[k]["tokens_per_s"], data[k]["tokens_per_s"] / base] for k in SYSTEMS]
    print_table(f"generation: {s['model']} ({data['settings']['params'] / 1e6:.1f} M params), {s['prompts']} prompts "
                f"x G={s['group_size']}, {s['max_tokens']} tokens, {THREADS} threads",
                ["system", "completions", "mean length", "seconds", "tokens/s", "vs HF fp32"], rows)
    save_result("generation", args.quick, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
