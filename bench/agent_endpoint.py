"""Agent code through the endpoint against today's Environment episodes, on the same task and the same engines:
episodes per second and sampled tokens per second.

    python -m bench.agent_endpoint [--quick]

SmolLM2-135M-Instruct (fp32) on the ``tool_choice`` problems with a calculator and a python tool, two ways over one
``RolloutPool`` of 2 vLLM engines: (a) the stock ``tool`` environment (``configs/smollm2_tools.yaml``'s episodes:
the framework parses the calls and runs the tools), (b) ``examples/math_agent.py`` as ``env.agent``
(``configs/smollm2_agent.yaml``: the agent's ``openai`` client calls the actor's endpoint over loopback HTTP and
runs the tools itself). The same rendered prompts (the agent sends the system prompt the tool config sets), G,
turn cap, sampling (temperature 1) and seeds. One warm-up call each, then the median of ``reps``; the model's
sampled text differs between the two only where the seeds meet other contexts.
"""

from __future__ import annotations

import os

from bench.common import parse_args, print_table, save_result, timed

FULL = dict(prompts=16, G=4, reps=3)
QUICK = dict(prompts=4, G=2, reps=1)


def measure(s: dict) -> dict:
    import ray

    from orchestrator.recipes.pipeline import config_or_stage
    from orchestrator.rl.launch import make_task, max_model_len
    from orchestrator.rl.pools import RolloutPool

    common = ["rollout.num_workers=2", f"rollout.group_size={s['G']}", "rollout.max_new_tokens=64",
              "env.max_total_tokens=640"]
    tools = config_or_stage("configs/smollm2_tools.yaml", common)
    tools.model.path = ".fleetrl/models/smollm2-135m-instruct"  # the base (the recipe's RL stage starts after SFT)
    configs = {"Environment (env.name: tool)": tools,
               "agent code (env.agent)": config_or_stage("configs/smollm2_agent.yaml", common)}
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    out = {}
    pool = None
    try:
        for name, cfg in configs.items():
            if pool is None:  # one pool of engines for both (the same engine settings and context)
                pool = RolloutPool(cfg, max_model_len=max_model_len(cfg))
            pool.cfg = cfg  # what its generate() runs: this config's episodes
            prompts = make_task(cfg).train_batch(0, s["prompts"])
            pool.generate(prompts, s["G"], 1.0, 99)  # warm-up (another seed)
            sec, samples = timed(lambda seed, p=pool, q=prompts: p.generate(q, s["G"], 1.0, seed), s["reps"])
            eps = [x.episode for x in samples]
            out[name] = {"seconds": sec, "episodes": len(samples), "episodes_per_s": len(samples) / sec,
                         "sampled_tokens_per_s": sum(sum(x.loss_mask) for x in samples) / sec,
                         "turns_mean": sum(e.turns for e in eps) / len(eps),
                         "tool_call_rate": sum(e.tool_calls > 0 for e in eps) / len(eps),
                         "errored": sum(e.errored for e in eps)}
    finally:
        ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    s = QUICK if args.quick else FULL
    results = measure(s)
    print_table(f"tool_choice on SmolLM2, {s['prompts']} prompts x G={s['G']}, 2 engines (median of {s['reps']})",
                ["episodes driven by", "episodes", "turns/episode", "tool-call rate", "errored", "seconds",
                 "episodes/s", "sampled tokens/s"],
                [[k, v["episodes"], round(v["turns_mean"], 2), round(v["tool_call_rate"], 2), v["errored"],
                  round(v["seconds"], 1), round(v["episodes_per_s"], 2), round(v["sampled_tokens_per_s"], 1)]
                 for k, v in results.items()])
    save_result("agent_endpoint", args.quick, {"settings": s, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
