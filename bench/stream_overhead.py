"""What generating step by step costs: the same requests through one ``LLM.generate`` call (how ``sync`` and
``one_step_off`` generate) and through :class:`workers.stream.Stream` (one ``LLMEngine.step`` at a time, every new
token stamped with its version: how a fully asynchronous mode generates), with and without a weight push in the
middle (partial rollouts: the unfinished requests aborted, the weights reloaded, the requests resubmitted with
their tokens so far, whose prefill is recomputed).

    python -m bench.stream_overhead [--quick]

One engine in this process, fp32, the benchmark's generation-heavy model (``bench.build_models``), 64 requests of
exactly 128 tokens (EOS ignored), temperature 1; each variant 3 times in turn, the median reported.
"""

from __future__ import annotations

import os
import time

from bench.build_models import model_path
from bench.common import median, parse_args, print_table, require_model, save_result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    path = str(model_path("gen-heavy"))
    require_model(path, "gen-heavy")
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from workers.stream import Stream

    n, tokens, reps = (16, 32, 1) if args.quick else (64, 128, 3)
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=2**29,
              seed=0, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
              # as the rollout actors run it: whole prompts only (a seeded prefill split across steps crashes
              # vLLM's CPU runner; resubmitted requests carry their tokens so far in the prompt)
              enable_chunked_prefill=False, max_num_batched_tokens=4096,
              worker_extension_cls="workers.nccl_sync.NcclWeightSyncExtension")
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [[3 + (i * 7 + j) % (vocab - 3) for j in range(24)] for i in range(n)]
    weights = load_file(f"{path}/model.safetensors")

    def params(max_tokens: int, seed: int | None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=0, seed=seed, ignore_eos=True)

    def one_call() -> int:
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           [params(tokens, i) for i in range(n)], use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in out)

    def stepped(push_at: int | None) -> int:
        stream = Stream(llm.llm_engine, params)
        for i, p in enumerate(prompts):
            stream.submit(f"r{i}", p, tokens, seed=i)
        done, steps = [], 0
        while stream.in_flight:
            done += stream.step()
            steps += 1
            if steps == push_at:
                stream.push(lambda: (llm.collective_rpc("fleetrl_reload_weights", args=(iter(weights.items()),)),
                                     llm.reset_prefix_cache()), 1)
        return sum(len(p.token_ids) for p in done)

    variants = {"LLM.generate (one call)": one_call, "Stream, stepped": lambda: stepped(None),
                "Stream, a push at mid-generation": lambda: stepped(tokens // 2)}
    one_call()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            got = fn()
            times[name].append(time.perf_counter() - t0)
            assert got == n * tokens, (name, got)
    base = median(times["LLM.generate (one call)"])
    rows = [[name, f"{median(t):.2f}", f"{n * tokens / median(t):.0f}", f"{median(t) / base:.2f}"]
            for name, t in times.items()]
    print_table(f"{n} requests x {tokens} tokens, fp32, one engine", ["variant", "seconds", "tokens/s", "x one call"],
                rows)
    save_result("stream_overhead", args.quick, {"requests": n, "tokens": tokens, "reps": reps,
                                                "seconds": {k: v for k, v in times.items()}})


if __name__ == "__main__":
    main()
