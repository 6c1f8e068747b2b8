"""Agent episodes: episodes per second of the calculator tool task with 1 and 2 rollout engines, with the plain
calculator and with one that sleeps 0.5 s per call (the episodes' tool waits overlap).

    python -m bench.agents [--quick]

One ``RolloutPool`` of 2 vLLM engines running ``configs/tool_calc.yaml``'s episodes (the embedded calculator
model at temperature 1: about a fifth of its episodes call the tool before training, every one after). The same
prompts x G go to one engine, then split over both (``RolloutPool.generate``). One warm-up call each, median
of ``reps``. "serial tool s" is what the sleeping calls would cost if they ran one after another.
"""

from __future__ import annotations

import os
import time

from bench.common import parse_args, print_table, save_result, timed
from workers.envs.tools import Tool, calculate

FULL = dict(prompts=16, G=8, reps=3)
QUICK = dict(prompts=4, G=4, reps=1)


def slow_calculator(expression: str) -> str:
    time.sleep(0.5)
    return calculate(expression)


SLOW = Tool("calculator", slow_calculator, "a calculator that takes 0.5 s")


def measure(s: dict, tools: str) -> dict:
    import ray

    from orchestrator.config import load_config
    from orchestrator.rl.launch import ensure_model, make_task, max_model_len
    from orchestrator.rl.pools import RolloutPool
    from orchestrator.rl.specs import env_spec

    cfg = load_config("configs/tool_calc.yaml", ["rollout.num_workers=2", f"env.tools=[{tools}]",
                                                 f"rollout.group_size={s['G']}"])
    ensure_model(cfg)
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    pool = RolloutPool(cfg, max_model_len=max_model_len(cfg))
    prompts = make_task(cfg).train_batch(0, s["prompts"])
    env = env_spec(cfg)
    triples = [(p.uid, p.text, p.metadata) for p in prompts]
    r = cfg.rollout

    def one(seed: int) -> list:
        return ray.get(pool.workers[0].run_episodes.remote(triples, s["G"], env, r.max_new_tokens, 1.0, 1.0, seed))

    def two(seed: int) -> list:
        return pool.generate(prompts, s["G"], 1.0, seed)

    out = {}
    for name, fn in (("1 engine", one), ("2 engines", two)):
        sec, samples = timed(fn, s["reps"])
        calls = sum(x.episode.tool_calls for x in samples)
        out[name] = {"seconds": sec, "episodes": len(samples), "episodes_per_s": len(samples) / sec,
                     "tool_calls": calls, "turns_mean": sum(x.episode.turns for x in samples) / len(samples)}
    ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    s = QUICK if args.quick else FULL
    results = {"calculator": measure(s, "calculator"), "calculator sleeping 0.5 s": measure(s, "bench.agents:SLOW")}
    rows = [[tool, engines, v["episodes"], v["tool_calls"], v["turns_mean"], v["seconds"], v["episodes_per_s"],
             0.5 * v["tool_calls"] if "sleeping" in tool else 0.0]
            for tool, by_engines in results.items() for engines, v in by_engines.items()]
    print_table(f"agents: {s['prompts']} prompts x G={s['G']} calculator episodes (median of {s['reps']})",
                ["tool", "engines", "episodes", "tool calls", "turns/episode", "seconds", "episodes/s",
                 "serial tool s"], rows)
    save_result("agents", args.quick, {"settings": s, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
