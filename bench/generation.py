"""Generation throughput: a fleetrl rollout worker (vLLM) vs HF ``generate`` on identical work.

    python -m bench.generation [--quick] [--threads N]

Same model (``bench-gen-heavy``, ~24 M params; ``--quick``: ``bench-gen-tiny``), same prompts (arithmetic
training prompts), same G, completion length and sampling (temperature 1, top-p 1, no top-k), fp32, and the same
number of CPU threads for both. The models never sample EOS (see :mod:`bench.build_models`), so every
completion has exactly the requested length in both systems; the table reports the measured mean length.

The worker is :class:`workers.rollout.RolloutWorker` itself, in-process (its ``generate`` also returns per-token
logprobs, which HF ``generate`` does not compute here). HF runs first: vLLM's CPU backend pins torch's thread
count once it starts. One untimed warm-up call each, then ``reps`` timed calls; the median is reported.
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

import time  # noqa: E402

import torch  # noqa: E402

from bench.build_models import model_path, params_of  # noqa: E402
from bench.common import median, parse_args, print_table, require_model, save_result  # noqa: E402
from rewards.tasks import ArithmeticTask  # noqa: E402

FULL = dict(model="gen-heavy", prompts=8, group_size=8, max_tokens=128, reps=3)
QUICK = dict(model="gen-tiny", prompts=4, group_size=4, max_tokens=32, reps=1)


def hf_generate(model, tok, prompts: list[str], group_size: int, max_tokens: int, seed: int) -> list[int]:
    """Completion lengths (tokens up to and including EOS) of one batched ``generate`` call."""
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, lambda ap: ap.add_argument(
        "--threads", type=int, default=2, help="CPU threads for both systems (default 2: the whole machine)"))
    s = QUICK if args.quick else FULL
    require_model(str(model_path(s["model"])), s["model"])
    path = str(model_path(s["model"]))
    torch.set_num_threads(THREADS)
    prompts = ArithmeticTask().train_batch(0, s["prompts"])
    texts = [p.text for p in prompts]
    G, L = s["group_size"], s["max_tokens"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_s, hf_len = timed(lambda r: hf_generate(model, tok, texts, G, L, seed=r), s["reps"])

    from workers.rollout import RolloutWorker

    worker = RolloutWorker(path, "float32", max_model_len=L + 32, kv_cache_gib=0.25, seed=0)
    triples = [(p.uid, p.text, p.metadata) for p in prompts]
    vllm_s, vllm_len = timed(lambda r: [len(x.completion_ids) for x in worker.generate(
        triples, G, L, temperature=1.0, top_p=1.0, seed=r)], s["reps"])

    rows, data = [], {"settings": {**s, "threads": THREADS, "params": params_of(s["model"]), "model_path": path}}
    for name, sec, lens in (("HF generate", hf_s, hf_len), ("fleetrl RolloutWorker (vLLM)", vllm_s, vllm_len)):
        tps = sum(lens) / sec
        data[name] = {"seconds": sec, "tokens": sum(lens), "tokens_per_s": tps, "mean_len": sum(lens) / len(lens)}
        rows.append([name, len(lens), sum(lens) / len(lens), sec, tps])
    data["speedup"] = data["fleetrl RolloutWorker (vLLM)"]["tokens_per_s"] / data["HF generate"]["tokens_per_s"]
    for r in rows:
        r.append(r[4] / rows[0][4])
    print_table(f"generation: {s['model']} ({data['settings']['params'] / 1e6:.1f} M params), {len(texts)} prompts x "
                f"G={G}, {L} tokens, {THREADS} threads",
                ["system", "completions", "mean length", "seconds", "tokens/s", "vs HF"], rows)
    save_result("generation", args.quick, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
