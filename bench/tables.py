"""The benchmark tables of docs/BENCHMARKS.md (and the README's benchmark line), generated from
``bench/results/*.json`` (numbers that cannot go stale: a table is rewritten from the result file it shows, with
the CPU, commit and date that file records).

A generated table sits between ``<!-- bench:NAME -->`` and ``<!-- /bench -->`` in the doc; :data:`TABLES` maps
NAME to the function that renders it from its result file.

    python -m bench.tables            # rewrite the tables of docs/BENCHMARKS.md and README.md from bench/results
    python -m bench.tables --check    # exit 1 when a table differs from its result file (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from bench.common import RESULTS_DIR, markdown_table

DOC = Path("docs/BENCHMARKS.md")
_BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /bench -->)", re.S)


def provenance(meta: dict) -> str:
    """Where a result file's numbers come from: CPU, commit, date (older files did not record the first two)."""
    if "cpu" not in meta:
        return (f"*Measured {meta.get('time', '?')}, {meta.get('cpus', '?')} cores; an older result file: CPU and "
                "commit not recorded.*")
    return f"*Measured on {meta['cpu']}, {meta.get('cpus', '?')} cores, commit `{meta.get('commit', '?')}`, " \
           f"{meta.get('time', '?')}.*"


def end_to_end(result: dict) -> str:
    """docs section 2: fleetrl vs TRL per case, ratios to TRL of the same case."""
    rows = []
    for case in ("small", "gen_heavy"):
        runs = result.get(case, {}).get("runs", [])
        trl = {r["system"]: r for r in runs if r["system"].startswith("TRL")}
        fp32 = trl.get("TRL GRPOTrainer (fp32)")
        bf16 = trl.get("TRL GRPOTrainer (bf16)")
        for r in runs:
            rows.append([case, r["system"], r["step_s"], r["completions_per_s"], r["mean_len"],
                         r["completions_per_s"] / fp32["completions_per_s"] if fp32 else "",
                         r["completions_per_s"] / bf16["completions_per_s"] if bf16 else "",
                         r.get("generate_s", ""), r.get("learner_s", ""), r.get("time/overhead_s", "")])
    table = markdown_table(["case", "system", "s/step", "completions/s", "mean completion len", "vs TRL fp32",
                            "vs TRL bf16", "generate s", "learner s", "overhead s"], rows)
    return f"{provenance(result['meta'])}\n\n{table}\n"


def _se(p: float, n: int) -> float:
    return (p * (1 - p) / n) ** 0.5


def smollm2_demo(result: dict) -> str:
    """docs section 6: the SmolLM2 GRPO run's held-out curve, and both evaluators on the base and final policy."""
    n = result["outside"]["final"]["n"]
    rows = [[e["step"], e["minutes"], f"{e['eval_accuracy']:.3f} ± {_se(e['eval_accuracy'], n):.3f}",
             e.get("restate_frac", "")] for e in result["evals"]]
    curve = markdown_table(["step", "minutes (training + evals)", "held-out greedy accuracy (fleetrl)",
                            "share restating the prompt"], rows)
    first, last = result["evals"][0]["eval_accuracy"], result["evals"][-1]["eval_accuracy"]
    out = result["outside"]
    both = markdown_table(["policy", "fleetrl eval (vLLM, final-answer rule)", "outside: last integer (HF generate)",
                           "outside: one number after the last '=', 'equals' or 'is'"], [
        ["base", f"{first:.3f}", *(f"{out['base'][rule]['accuracy']:.3f}" for rule in ("last_int", "single"))],
        [f"after {result['summary']['steps']} steps", f"{last:.3f}",
         *(f"{out['final'][rule]['accuracy']:.3f}" for rule in ("last_int", "single"))]])
    return (f"{provenance(result['meta'])} {n} held-out prompts; ± is the binomial standard error.\n\n{curve}\n\n"
            f"{both}\n")


def lora_accuracy(result: dict) -> str:
    """docs section 11: the LoRA demo's held-out accuracy against wall-clock minutes, beside the full fine-tuning
    demo's (``smollm2_demo.json``) at the same steps, and both evaluators on both final policies."""
    full = json.loads((RESULTS_DIR / "smollm2_demo.json").read_text())
    n = result["outside"]["final"]["n"]
    by_step = {e["step"]: e for e in full["evals"]}
    rows = [[e["step"], *((f"{f['minutes']}", f"{f['eval_accuracy']:.3f}") if (f := by_step.get(e["step"])) else
                          ("", "")), e["minutes"], f"{e['eval_accuracy']:.3f}"] for e in result["evals"]]
    rows += [[f"end (step {f['step']})", f["minutes"], f"{f['eval_accuracy']:.3f}", "", ""]
             for f in full["evals"] if f["step"] not in {e["step"] for e in result["evals"]}]
    curve = markdown_table(["step", "full fine-tuning: minutes (training + evals)", "held-out accuracy",
                            "LoRA: minutes", "held-out accuracy"], rows)
    rules = ("last_int", "single")
    both = markdown_table(
        ["policy", "steps", "minutes", "median s/step", "fleetrl eval (vLLM)", "outside: last integer (HF generate)",
         "outside: one number after the last '=', 'equals' or 'is'"],
        [["base", 0, 0, "", f"{result['evals'][0]['eval_accuracy']:.3f}",
          *(f"{result['outside']['base'][r]['accuracy']:.3f}" for r in rules)]] +
        [[name, r["summary"]["steps"], r["evals"][-1]["minutes"], round(r["median_step_s"], 1),
          f"{r['evals'][-1]['eval_accuracy']:.3f}",
          *(f"{r['outside']['final'][rule]['accuracy']:.3f}" for rule in rules)]
         for name, r in ((f"full fine-tuning (`{full['config']}`)", full), (f"LoRA (`{result['config']}`)", result))])
    return (f"LoRA: {provenance(result['meta'])} Full fine-tuning: {provenance(full['meta'])} {n} held-out "
            f"prompts, greedy; the binomial standard error is 0.03-0.035 at these accuracies.\n\n{curve}\n\n{both}\n")


def startup(result: dict) -> str:
    """docs section 9: launch -> actors up and -> first step, before and after a change (medians)."""
    before, after = result.get("before", {}), result["after"]
    rows = []
    for case, a in after.items():
        if not isinstance(a, dict) or "runs" not in a:
            continue
        b = before.get(case, {})
        rows.append([case, len(a["runs"]), b.get("actors_up_s", ""), a["actors_up_s"],
                     f"{a['actors_up_s'] / b['actors_up_s']:.2f}" if b else "", b.get("first_step_s", ""),
                     a["first_step_s"], f"{a['first_step_s'] / b['first_step_s']:.2f}" if b else ""])
    table = markdown_table(["config", "runs (median of)", "actors up s, before", "after", "after / before",
                            "first step s, before", "after", "after / before"], rows)
    return (f"{provenance(result['meta'])} Before: commit `{before.get('commit', '?')}`; after: the commit "
            f"named.\n\n{table}\n")


def startup_fleet(result: dict) -> str:
    """docs section 9: supervised stages without engines and the R1 pipeline on one fleet, before and after."""
    before, after = result.get("before", {}), result["after"]
    singles, pipeline = [], []
    for case, a in after.items():
        if not isinstance(a, dict) or "runs" not in a:
            continue
        b = before.get(case, {})
        if case == "r1_pipeline":
            for key, label in (("startup_sum_s", "stages' start-up, summed"), ("wall_s", "wall time")):
                pipeline.append([label, b.get(key, ""), a[key], f"{a[key] / b[key]:.2f}" if b else ""])
            stages = ["per stage, run 1: " + " / ".join(f"{v:g}" for v in side["runs"][0]["stage_startup_s"])
                      for side in (b, a) if side]
            pipeline.append(["stage start-up s (each stage)", *stages, ""])
            continue
        singles.append([case, len(a["runs"]), b.get("actors_up_s", ""), a["actors_up_s"],
                        f"{a['actors_up_s'] / b['actors_up_s']:.2f}" if b else "", b.get("exit_s", ""), a["exit_s"],
                        f"{a['exit_s'] / b['exit_s']:.2f}" if b else ""])
    one = markdown_table(["stage (one step, no evals)", "runs (median of)", "actors up s, before", "after",
                          "after / before", "launch to exit s, before", "after", "after / before"], singles)
    two = markdown_table(["`configs/r1.yaml`, 5 stages, 2 steps each (median of 3)", "before", "after",
                          "after / before"], pipeline)
    return (f"{provenance(result['meta'])} Before: commit `{before.get('commit', '?')}`; after: commit "
            f"`{result.get('after_commit', 'named')}`.\n\n{one}\n\n{two}\n")


def startup_profile(result: dict) -> str:
    """docs section 9: where the default config's start-up goes."""
    phases = markdown_table(["phase (driver)", "s"], [[k, v] for k, v in result["phases_s"].items()])
    cpu = markdown_table(["process", "CPU s each, until every actor is ready"],
                         [[k, ", ".join(str(x) for x in v)] for k, v in result["cpu_s"].items()])
    ready = ", ".join(f"{k} at {v} s" for k, v in result["ready_at_s"].items())
    return f"{provenance(result['meta'])}\n\n{phases}\n\nReady: {ready}.\n\n{cpu}\n"


def learner_memory(result: dict) -> str:
    """docs section 7: memory and time of one update per learner layout (torch only, one process)."""
    rows = [[r["variant"], r["peak_rss_mb"], r["update_peak_mb"], r["update_s"],
             f"{r.get('max_logp_diff_vs_naive', 0.0):.1e}"] for r in result["results"]]
    base = result["results"][0]
    for row, r in zip(rows, result["results"]):
        row[3:3] = [round(base["update_peak_mb"] / max(r["update_peak_mb"], 1), 2)]
        row.insert(5, round(base["update_s"] / r["update_s"], 2))
    table = markdown_table(["variant", "peak RSS MB", "update peak MB", "memory x lower", "s/update", "speed-up",
                            "max \\|dlogp\\| vs naive"], rows)
    return (f"{provenance(result['meta'])} {result['samples']} samples, responses <= {result['max_response']} "
            f"tokens, `{result['model']}`.\n\n{table}\n")


def learner_overhead(result: dict) -> str:
    """docs section 10: fleetrl's DeepSpeed update against a plain torch loop, per ranks x threads and ZeRO knob."""
    base = result["results"][0]
    rows = [[r["variant"], r["update_s"], f"{r['update_s'] / base['update_s']:.2f}",
             " + ".join(str(p) for p in r["peak_rss_mb"]), f"{r['max_logp_diff_vs_torch']:.1e}"]
            for r in result["results"]]
    table = markdown_table(["variant", "s/update (median)", "x torch loop", "peak RSS MB per process",
                            "max \\|dlogp\\| vs torch loop"], rows)
    return (f"{provenance(result['meta'])} {result['samples']} samples x {result['response']} response tokens, "
            f"`{result['model']}`, fp32, median of {result['repeats']} updates after a warm-up.\n\n{table}\n")


def smollm2(result: dict) -> str:
    """docs section 8: fleetrl vs TRL's GRPOTrainer on SmolLM2 (s/step, completions/s, peak memory)."""
    f, t = result["fleetrl"], result["trl"]
    rows = [["fleetrl (2 engines, 2 ZeRO-2 ranks)", f["step_s"], f["completions_per_s"],
             f"learner rank {round(f['learner_peak_rss_mb'])} (all {len(f['peak_rss_mb'])} actors together "
             f"{round(sum(f['peak_rss_mb'].values()))})", f.get("rollout_tokens_per_s", ""), f.get("push_s", "")],
            ["TRL GRPOTrainer", t["step_s"], t["completions_per_s"], f"{round(t['peak_rss_mb'])} (its one process)",
             "", ""]]
    table = markdown_table(["system", "s/step", "completions/s", "peak memory MB", "rollout tok/s", "push s"], rows)
    return (f"{provenance(result['meta'])} {result['P']} prompts x G={result['G']}, completions <= {result['L']} "
            f"tokens; fleetrl / TRL completions per second: {result['ratio_completions_per_s']:.2f}.\n\n{table}\n")


def lora(result: dict) -> str:
    """docs section 11: LoRA ranks against full fine-tuning on SmolLM2 (learner time, memory, push)."""
    from bench.lora import table

    headers, rows = table(result["variants"], result["meta"].get("commit", ""))
    return (f"{provenance(result['meta'])} `{result['config']}`, {result['steps']} steps per run, the first "
            f"dropped, medians.\n\n{markdown_table(headers, rows)}\n")


def verify_throughput(result: dict) -> str:
    """docs section 12: the final-answer rule's completions per second, before/after, in-process and bounded."""
    rows = []
    for key, label in (("before_in_process", "earlier rule (--checkout), in-process (no limit)"),
                       ("in_process", "rule now, in-process (no limit)"),
                       ("bounded_pool", "rule now, bounded pool (2 processes; the driver and reward actors)")):
        if key in result:
            r = result[key]
            rows.append([label, r["seconds"], r["per_s"], r["paid"]])
    table = markdown_table(["rule and path", "seconds", "completions/s", "paid (of the same completions)"], rows)
    load = ", ".join(f"{x:.2f}" for x in result["meta"]["loadavg_1_5_15min"])
    return f"{provenance(result['meta'])} {result['n']} completions; load average at the end {load}.\n\n{table}\n"


def async_modes(result: dict) -> str:
    """docs section 13: the rollout modes in the disaggregated layout, and the calibrated simulator beside them."""
    measured, sim = result["measured"], result["simulated_x_sync"]
    base = measured["sync"]["completions_per_s"]
    rows = [[name, m["completions_per_s"], f"{m['completions_per_s'] / base:.2f}x", f"{sim[name]:.2f}x",
             m["step_s"], m["engine_idle"], m["learner_idle"], m["staleness_max"], m["partial_frac"], m["dropped"]]
            for name, m in measured.items()]
    table = markdown_table(["mode", "completions/s", "x sync", "x sync, simulated", "s/step", "engine idle",
                            "learner idle", "staleness max", "partial", "dropped groups"], rows)
    load = ", ".join(f"{x:.2f}" for x in result["meta"]["loadavg_1_5_15min"])
    lengths = f"mean completion {result['mean_length']:.1f} tokens of {result['case']['L']}"
    return f"{provenance(result['meta'])} Load average at the end {load}; {lengths}.\n\n{table}\n"


def async_learning(result: dict) -> str:
    """docs section 13: held-out accuracy of the embedded default in sync and async, and the outside check."""
    rows = []
    for r in result["runs"].values():
        curve = r["curve"]
        out = r["outside_last_int"]
        rows.append([r["mode"], r["seed"], curve[0][2], curve[-1][2], f"{out['accuracy']:.3f} +- {out['se']:.3f}",
                     curve[-1][1], " ".join(f"{a:.2f}@{m:.1f}" for _, m, a in curve)])
    table = markdown_table(["mode", "seed", "eval first", "eval last", "outside check (last int)",
                            "train + eval minutes", "accuracy @ minutes"], rows)
    return f"{provenance(result['meta'])}\n\n{table}\n"


def distill_compare(result: dict) -> str:
    """docs/recipes.md: on-policy distillation, GRPO and offline distillation from one teacher, equal training time,
    each final policy scored outside fleetrl."""
    labels = {"base": "base (SmolLM2-135M-Instruct)", "teacher": "teacher (the GRPO demo's final policy)",
              "on_policy_distill": "(a) on-policy distillation", "grpo": "(b) GRPO from the base",
              "offline_distill": "(c) offline distillation (distill + SFT)"}
    rows = []
    for name, r in result["runs"].items():
        out = r["outside"]["last_int"]
        minutes = f"{r['wall_s'] / 60:.1f}" if "wall_s" in r else ""
        curve = " ".join(f"{a:.2f}@{m:.1f}" for _, m, a in r.get("curve", []))
        rows.append([labels.get(name, name), r.get("steps", ""), minutes, f"{out['accuracy']:.3f} +- {out['se']:.3f}",
                     curve])
    table = markdown_table(["policy", "steps", "wall minutes", "outside check (last int, 200 prompts)",
                            "fleetrl eval accuracy @ training minutes"], rows)
    s = result["settings"]
    return (f"{provenance(result['meta'])} Training budget {s['minutes']:g} min per path; offline distillation's "
            f"teacher generation ({s['distill_prompts']} prompts) comes on top.\n\n{table}\n")


def learning_real(result: dict) -> str:
    """docs/results.md: fleetrl and TRL's GRPOTrainer on SmolLM2, several seeds each, scored outside both."""
    base, n = result["base"]["last_int"], result["settings"]["eval_size"]
    rows = [["base (both)", 0, "", f"{base['accuracy']:.3f}", "", "", ""]]
    for r in result["summary"]:
        rows.append([r["system"], r["step"], r["seeds"], f"{r['accuracy_mean']:.3f} +- {r['accuracy_sd']:.3f}",
                     " ".join(f"{a:.2f}" for a in r["per_seed"]), f"{r['single_mean']:.3f}",
                     f"{r['minutes_mean']:.1f} +- {r['minutes_sd']:.1f}"])
    table = markdown_table(["system", "step", "seeds", f"outside accuracy, last int ({n} prompts): mean +- sd",
                            "per seed", "single-answer rule", "training minutes"], rows)
    return f"{provenance(result['meta'])} Seeds {result['settings']['seeds']}.\n\n{table}\n"


def sampling_parity(result: dict) -> str:
    """docs/results.md: a fleetrl engine's samples against transformers ``generate``'s, same model and settings."""
    s = result["settings"]
    ways = markdown_table(["direction", "tokens", "mean abs diff", "p99 abs diff", "max abs diff"],
                          [[k.replace("_", " "), v["tokens"], f"{v['mean_abs']:.1e}", f"{v['p99_abs']:.1e}",
                            f"{v['max_abs']:.1e}"] for k, v in result["both_ways"].items()])
    rows = [[name, *(f"{v[r]['accuracy']:.3f} +- {v[r]['se']:.3f}" for r in ("last_int", "single", "math_verifier")),
             v["mean_tokens"], v["ended_rate"], v["mean_logprob_per_token"]] for name, v in result["samplers"].items()]
    table = markdown_table(["sampler", "last int", "single answer", "math verifier", "tokens/sample",
                            "ended at end of turn", "logprob/token"], rows)
    return (f"{provenance(result['meta'])} Temperature {s['temperature']:g}, top-p 1, no top-k; "
            f"{result['samples']} samples each ({result['prompts']} prompts x 5). Accuracy gap (last int): "
            f"{result['accuracy_gap_se']} standard errors.\n\n{ways}\n\n{table}\n")


def r1_recipes(result: dict) -> str:
    """docs/recipes.md: the two SmolLM2 R1 recipes, each stage scored by fleetrl's eval and outside it."""
    n = result["base"]["n"]
    base = result["base"]["last_int"]
    rows = [["base (SmolLM2-135M-Instruct)", "-", "-", f"{base['accuracy']:.3f} +- {base['se']:.3f}", "-"]]
    for name, run in result["recipes"].items():
        for st in run["stages"]:
            out = st["outside"]["last_int"]
            rows.append([f"`{name}`", f"{st['name']} ({st['kind']})", "-" if st["accuracy"] is None else
                         f"{st['accuracy']:.3f}",
                         f"{out['accuracy']:.3f} +- {out['se']:.3f}", f"{st['seconds'] / 60:.1f}"])
        rows.append([f"`{name}`", "**total**", "", "", f"**{sum(s['seconds'] for s in run['stages']) / 60:.1f}**"])
    dtype = "bf16 engines and learner" if result["settings"].get("bf16") else "fp32"
    table = markdown_table(["recipe", "stage", "fleetrl eval (greedy)", f"outside check (last int, {n} prompts)",
                            "minutes"], rows)
    return f"{provenance(result['meta'])} {dtype}; each recipe alone on the machine.\n\n{table}\n"


def agent_example(result: dict) -> str:
    """docs/agents.md: examples/math_agent.py trained (tool SFT, then GRPO through the endpoint), each policy checked
    by fleetrl's eval, the outside check and the agent itself on vLLM's own server."""
    def cells(entry: dict) -> list:
        o, v = entry["outside"], entry["vllm_serve"]
        lg = entry.get("vllm_serve_langgraph")
        return [f"{o['last_int']['accuracy']:.2f} +- {o['last_int']['se']:.2f}", f"{o['tool_call_rate']:.2f}",
                f"{o['right_tool_rate']:.2f}" if "right_tool_rate" in o else "-",
                f"{v['accuracy']:.2f} (tool calls {v['tool_call_rate']:.2f})",
                "-" if lg is None else f"{lg['accuracy']:.2f} (tool calls {lg['tool_call_rate']:.2f})"]

    def ours(st: dict) -> str:
        ev = st["eval"]
        calls = ev.get("eval/tool_call_rate")
        return f"{ev['eval/accuracy']:.2f}" + ("" if calls is None else f" (tool calls {calls:.2f})")

    rows = [["SmolLM2-135M-Instruct", "-", *cells(result["base"]), "-"]]
    rows += [[f"after {st['name']} ({st['kind']}, {st['steps']} steps)", ours(st), *cells(st),
              f"{st['seconds'] / 60:.1f}"] for st in result["stages"]]
    dtype = "bf16 engines and learner" if result["settings"].get("bf16") else "fp32"
    n = result["base"]["outside"]["n"]
    table = markdown_table(["policy", "fleetrl eval (greedy)", f"outside check ({n} problems)", "tool calls",
                            "right tool", "math_agent.py on vLLM's server", "langgraph_agent.py on vLLM's server",
                            "minutes"], rows)
    return f"{provenance(result['meta'])} {dtype}.\n\n{table}\n"


def async_cluster(result: dict) -> str:
    """docs section 13: verl's published fully async speed-ups beside the simulator's, calibrated on the colocated
    rows."""
    rows = []
    for n, r in result["setups"].items():
        pub, pred = r["published"], r["predicted_step_s"]
        rows.append([n, pub["sync_step"], pred["sync"], pub["async_step"],
                     f"{pub['sync_step'] / pub['async_step']:.2f}x", pred["async"],
                     f"{pred['sync'] / pred['async']:.2f}x", pred["async_measured_learner"],
                     f"{pred['sync'] / pred['async_measured_learner']:.2f}x"])
    table = markdown_table(["GPUs", "sync s/step, published", "sync s/step, model", "async s/step, published",
                            "async x sync, published", "async s/step, model", "async x sync, model",
                            "async s/step, model with verl's async trainer", "x sync"], rows)
    return f"{provenance(result['meta'])}\n\n{table}\n"


def readme_end_to_end(result: dict) -> str:
    """README: the generation-heavy row of section 2 in one line, with its machine."""
    runs = {r["system"]: r for r in result["gen_heavy"]["runs"]}
    f, trl = runs["fleetrl (sync, fp32)"], runs["TRL GRPOTrainer (fp32)"]
    return (f"End to end against TRL's `GRPOTrainer` on the generation-heavy config, all fp32 (docs/BENCHMARKS.md "
            f"section 2): **{f['completions_per_s'] / trl['completions_per_s']:.2f}x TRL's completions/s** "
            f"({f['step_s']:.1f} vs {trl['step_s']:.1f} s per step; update {f['learner_s']:.1f} vs "
            f"{trl['learner_s']:.1f} s), on {result['meta']['cpu']}, commit `{result['meta']['commit']}`.\n")


TABLES: dict[str, tuple[str, Callable[[dict], str]]] = {
    "end_to_end": ("end_to_end.json", end_to_end),
    "smollm2_demo": ("smollm2_demo.json", smollm2_demo),
    "startup": ("startup.json", startup),
    "startup_models": ("startup_models.json", startup),
    "startup_profile": ("startup_profile.json", startup_profile),
    "startup_fleet": ("startup_fleet.json", startup_fleet),
    "learner_memory": ("learner_memory.json", learner_memory),
    "learner_overhead": ("learner_overhead.json", learner_overhead),
    "smollm2": ("smollm2.json", smollm2),
    "lora": ("lora.json", lora),
    "lora_accuracy": ("smollm2_demo_lora.json", lora_accuracy),
    "readme_end_to_end": ("end_to_end.json", readme_end_to_end),
    "verify_throughput": ("verify_throughput.json", verify_throughput),
    "async_modes": ("async.json", async_modes),
    "async_learning": ("async_learning.json", async_learning),
    "async_cluster": ("async_cluster.json", async_cluster),
    "distill_compare": ("distill_compare.json", distill_compare),
    "learning_real": ("learning_real.json", learning_real),
    "learning_real_async": ("learning_real-fleetrl-async.json", learning_real),
    "sampling_parity": ("sampling_parity.json", sampling_parity),
    "r1_recipes": ("r1_recipes.json", r1_recipes),
    "agent_example": ("agent_example.json", agent_example),
}
"""Table name -> (result file in bench/results, renderer)."""
DOCS = [DOC, Path("README.md"), Path("docs/recipes.md"), Path("docs/results.md"), Path("docs/agents.md")]
"""The pages whose ``<!-- bench:NAME -->`` blocks are generated."""


def render(doc: str, results_dir: Path = RESULTS_DIR) -> str:
    """``doc`` with every generated table rewritten from its result file (a table whose file is missing says so)."""
    def block(m: re.Match) -> str:
        name = m.group("name")
        if name not in TABLES:
            raise KeyError(f"{DOC}: unknown generated table {name!r}; known: {sorted(TABLES)}")
        file, renderer = TABLES[name]
        path = results_dir / file
        body = renderer(json.loads(path.read_text())) if path.exists() else f"*No result yet: bench/results/{file}.*\n"
        return f"{m.group(1)}{body}{m.group(4)}"

    return _BLOCK.sub(block, doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only check; exit 1 when a table is stale")
    args = ap.parse_args(argv)
    stale = [page for page in DOCS if render(page.read_text()) != page.read_text()]
    if args.check:
        for page in stale:
            print(f"{page}: a generated table differs from bench/results; run `python -m bench.tables`",
                  file=sys.stderr)
        return 1 if stale else 0
    for page in stale:
        page.write_text(render(page.read_text()))
    print(f"rewrote the generated tables of {', '.join(map(str, stale)) or 'nothing (all current)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
