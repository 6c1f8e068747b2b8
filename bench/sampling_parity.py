"""Does a fleetrl rollout engine sample the distribution transformers' ``generate`` samples? SmolLM2-135M-Instruct
in fp32 on the GRPO demo's chat prompts (``configs/smollm2_arith.yaml``), temperature T, top-p 1, no top-k.

    python -m bench.sampling_parity [--samples 1000] [--temperature 1.0] [--quick]

1. **The same prefixes, both ways.** Completions sampled by a fleetrl engine (``RolloutWorker.generate``: vLLM, the
   sampled tokens' logprobs as the engine reports them, which are what the learner's importance ratio starts from)
   are scored by transformers (one forward pass over prompt + completion, log-softmax of logits / T); completions
   sampled by transformers ``generate`` (its processed scores) are scored by the engine
   (``RolloutWorker.token_logprobs``: vLLM prompt logprobs; T = 1 only). Per-token |difference|: mean, p99, max.
2. **The samples themselves.** ``--samples`` completions from each sampler (``--samples / 5`` held-out prompts x 5),
   scored by :mod:`bench.outside_eval`'s two rules and fleetrl's ``math`` verifier: accuracy with its binomial
   standard error, the difference in standard errors, mean completion length and end-of-turn rate.

Both in one process on the machine's cores: transformers samples first, then the engine samples and scores them,
then transformers scores the engine's samples.
"""

from __future__ import annotations

import math
import statistics
import time

from bench.common import parse_args, print_table, save_result

CONFIG = "configs/smollm2_arith.yaml"


def _extra(ap) -> None:
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)


def engine_samples(cfg, prompts, per_prompt: int, temperature: float, seed: int):
    """The engine's samples of every prompt, and the engine's logprobs of ``scored`` sequences (a callback run
    while the engine is up)."""
    from orchestrator.rl.specs import engine_spec
    from workers.rollout import RolloutWorker

    engine = RolloutWorker(engine_spec(cfg, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens + 1))
    batch = [(f"p{i}", p.text, p.metadata) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    samples = engine.generate(batch, per_prompt, cfg.rollout.max_new_tokens, temperature, 1.0, seed)
    return engine, samples, time.perf_counter() - t


def hf_logprobs(model, sequences: list[tuple[list[int], list[int]]], temperature: float, pad: int,
                batch: int = 25) -> list[list[float]]:
    """transformers' logprob of each completion token given everything before it (log-softmax of logits / T), in
    left-padded batches (the attention mask and position ids make padding invisible)."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(sequences), batch):
            chunk = [list(p) + list(c) for p, c in sequences[i:i + batch]]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(x)) + x for x in chunk])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float() / temperature
            lp = torch.log_softmax(logits, dim=-1)
            for k, (_, completion) in enumerate(sequences[i:i + batch]):
                start = width - len(completion)  # completion tokens sit at the right end
                rows = torch.arange(start - 1, width - 1)
                out.append(lp[k, rows, torch.tensor(completion)].tolist())
    return out


def hf_samples(model, tok, prompt_ids: list[list[int]], per_prompt: int, max_new: int, temperature: float,
               seed: int, batch: int = 50):
    """transformers ``generate`` samples: (prompt ids, completion ids, their logprobs from generate's processed
    scores), end-of-turn kept as the last completion token as the engine keeps it."""
    import torch

    torch.manual_seed(seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = [p for p in prompt_ids for _ in range(per_prompt)]
    out, t = [], time.perf_counter()
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                                 top_p=1.0, top_k=0, max_new_tokens=max_new, pad_token_id=pad,
                                 output_scores=True, return_dict_in_generate=True)
        new = gen.sequences[:, width:]
        lps = torch.stack([torch.log_softmax(s.float(), -1) for s in gen.scores], 1)  # (batch, steps, vocab)
        for k, p in enumerate(chunk):
            comp, lp = [], []
            for step, token in enumerate(new[k].tolist()):
                comp.append(token)
                lp.append(lps[k, step, token].item())
                if token in _eos_ids(model):
                    break
            out.append((p, comp, lp))
    return out, time.perf_counter() - t


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def diff_stats(a: list[list[float]], b: list[list[float]]) -> dict:
    d = sorted(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))
    return {"tokens": len(d), "mean_abs": statistics.fmean(d), "p99_abs": d[int(0.99 * (len(d) - 1))],
            "max_abs": d[-1]}


def accuracy(replies: list[str], metas: list[dict], prompts_text: list[str]) -> dict:
    from bench.outside_eval import last_int, single
    from rewards.functions import math_reward

    n = len(replies)
    out = {}
    for rule, fn in (("last_int", lambda r, m, p: last_int(r, m["answer"])),
                     ("single", lambda r, m, p: single(r, m["answer"])),
                     ("math_verifier", lambda r, m, p: math_reward(p, r, m) >= 1.0)):
        acc = sum(bool(fn(r, m, p)) for r, m, p in zip(replies, metas, prompts_text)) / n
        out[rule] = {"accuracy": round(acc, 4), "se": round(math.sqrt(acc * (1 - acc) / n), 4)}
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, extra=_extra)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator.config import load_config
    from rewards.tasks import make_task_from_config

    torch.set_num_threads(2)
    n = 100 if args.quick else args.samples
    per_prompt = 5
    cfg = load_config(CONFIG, [f"rollout.temperature={args.temperature}", "rollout.num_workers=1"])
    prompts = make_task_from_config(cfg.data).eval_set(n // per_prompt)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    from workers.prompts import PromptRenderer, pad_token_id

    renderer = PromptRenderer(tok, cfg.data.prompt_format, cfg.data.system_prompt)  # the engine's own rendering
    prompt_ids = [renderer.render(p.text)[1] for p in prompts]
    # transformers first: the in-process vLLM engine would leave torch one thread
    hf, hf_s = hf_samples(model, tok, prompt_ids, per_prompt, cfg.rollout.max_new_tokens, args.temperature,
                          args.seed)
    engine, fl, fl_s = engine_samples(cfg, prompts, per_prompt, args.temperature, args.seed)
    assert [s.prompt_ids for s in fl[::per_prompt]] == prompt_ids, "the engine rendered other prompt ids"
    torch.set_num_threads(2)
    both_ways = {"engine_samples_scored_by_transformers": diff_stats(
        [s.logprobs for s in fl], hf_logprobs(model, [(s.prompt_ids, s.completion_ids) for s in fl],
                                              args.temperature, pad_token_id(tok)))}
    if args.temperature == 1.0:
        both_ways["generate_samples_scored_by_engine"] = diff_stats(
            [lp for _, _, lp in hf], engine.token_logprobs([(p, c) for p, c, _ in hf]))
    del engine
    metas = [p.metadata for p in prompts for _ in range(per_prompt)]
    texts = [p.text for p in prompts for _ in range(per_prompt)]
    eot = _eos_ids(model)
    samplers = {
        "fleetrl engine (vLLM)": ([s.completion_text for s in fl], [s.completion_ids for s in fl], fl_s),
        "transformers generate": ([tok.decode(c, skip_special_tokens=True) for _, c, _ in hf],
                                  [c for _, c, _ in hf], hf_s),
    }
    report = {"settings": vars(args), "samples": n, "prompts": len(prompts), "both_ways": both_ways, "samplers": {}}
    for name, (replies, comps, seconds) in samplers.items():
        report["samplers"][name] = {
            **accuracy(replies, metas, texts), "mean_tokens": round(statistics.fmean(map(len, comps)), 2),
            "ended_rate": round(sum(bool(c) and c[-1] in eot for c in comps) / len(comps), 4),
            "mean_logprob_per_token": None, "seconds": round(seconds, 1), "examples": replies[:6]}
    for name, lps in (("fleetrl engine (vLLM)", [s.logprobs for s in fl]),
                      ("transformers generate", [lp for _, _, lp in hf])):
        report["samplers"][name]["mean_logprob_per_token"] = round(statistics.fmean(x for xs in lps for x in xs), 4)
    a, b = (report["samplers"][k]["last_int"] for k in samplers)
    report["accuracy_gap_se"] = round((a["accuracy"] - b["accuracy"]) / math.sqrt(a["se"] ** 2 + b["se"] ** 2 or 1),
                                      2)
    print_table(f"Per-token logprobs on the same prefixes (T={args.temperature})",
                ["direction", "tokens", "mean |diff|", "p99 |diff|", "max |diff|"],
                [[k, v["tokens"], f"{v['mean_abs']:.2e}", f"{v['p99_abs']:.2e}", f"{v['max_abs']:.2e}"]
                 for k, v in both_ways.items()])
    print_table(f"{n} samples each (T={args.temperature}, top-p 1, no top-k)",
                ["sampler", "last int", "single", "math verifier", "tokens", "ended", "logprob/token"],
                [[k, *(f"{v[r]['accuracy']:.3f} +- {v[r]['se']:.3f}" for r in ("last_int", "single",
                                                                                 "math_verifier")),
                  v["mean_tokens"], v["ended_rate"], v["mean_logprob_per_token"]]
                 for k, v in report["samplers"].items()])
    print(f"accuracy gap (last int): {report['accuracy_gap_se']} SE")
    save_result("sampling_parity", args.quick, report)


if __name__ == "__main__":
    main()
