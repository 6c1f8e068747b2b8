"""Scaling: rollout tokens/s with 1 vs 2 workers; learner time with 1 vs 2 ranks; step time vs G and vs length.

    python -m bench.scaling [--quick]

All on the generation-heavy model (``bench-gen-heavy``, ~24 M params, never samples EOS, so completions have
exactly the requested length; ``--quick``: ``bench-gen-tiny``).

* Rollout: one ``RolloutPool`` of 2 vLLM engines (the trainer's pool); the same prompts x G go to one engine,
  then split over both (``RolloutPool.generate``). One warm-up call each, median of ``reps``.
* Training: ``configs/gen_heavy.yaml`` runs of a few steps each (first step dropped as warm-up), varying one
  knob from a base point: G, the completion length, and the learner ranks. "learner s" is the learner's share
  of the step (``time/logprobs_s`` + ``time/learn_s``).
"""

from __future__ import annotations

import os

from bench.build_models import model_path
from bench.common import median, parse_args, print_table, require_model, run_fleetrl, save_result, timed, training_rows

FULL = dict(preset="gen-heavy", P=4, base=dict(G=8, L=64, ranks=2), G=[4, 16], L=[32, 128], ranks=[1],
            steps=3, rollout_prompts=8, rollout_G=8, rollout_L=128, reps=3)
QUICK = dict(preset="gen-tiny", P=2, base=dict(G=4, L=16, ranks=2), G=[], L=[], ranks=[1], steps=2,
             rollout_prompts=4, rollout_G=4, rollout_L=32, reps=1)


def rollout_scaling(s: dict) -> dict:
    """tokens/s of the same generate call on 1 engine and split over 2."""
    import ray

    from orchestrator.config import load_config
    from orchestrator.rl.pools import RolloutPool
    from rewards.tasks import ArithmeticTask

    path = str(model_path(s["preset"]))
    G, L = s["rollout_G"], s["rollout_L"]
    cfg = load_config(None, [f"model.path={path}", "rollout.num_workers=2", f"rollout.max_new_tokens={L}",
                             f"rollout.group_size={G}"])
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False)
    pool = RolloutPool(cfg, max_model_len=L + 32)
    prompts = ArithmeticTask().train_batch(0, s["rollout_prompts"])
    triples = [(p.uid, p.text, p.metadata) for p in prompts]

    def one(seed: int) -> int:
        return sum(len(x.completion_ids) for x in ray.get(pool.workers[0].generate.remote(triples, G, L, 1.0, 1.0,
                                                                                          seed)))

    def two(seed: int) -> int:
        return sum(len(x.completion_ids) for x in pool.generate(prompts, G, 1.0, seed))

    out = {}
    for name, fn in (("1 worker", one), ("2 workers", two)):
        sec, tokens = timed(fn, s["reps"])
        out[name] = {"seconds": sec, "tokens": tokens, "tokens_per_s": tokens / sec}
    ray.shutdown()
    return out


def sweep_points(s: dict) -> list[dict]:
    """The base point, then one knob changed at a time."""
    base = s["base"]
    points = [dict(base, varied="base")]
    points += [dict(base, G=g, varied="G") for g in s["G"]]
    points += [dict(base, L=length, varied="L") for length in s["L"]]
    points += [dict(base, ranks=r, varied="ranks") for r in s["ranks"]]
    return points


def step_point(s: dict, p: dict, tag: str) -> dict:
    """A short fleetrl run at point ``p``; medians of the measured steps."""
    name = f"scaling-G{p['G']}-L{p['L']}-r{p['ranks']}{tag}"
    run = run_fleetrl(name, "configs/gen_heavy.yaml", [
        f"model.path={model_path(s['preset'])}", f"data.prompts_per_step={s['P']}", f"rollout.group_size={p['G']}",
        f"rollout.max_new_tokens={p['L']}", f"learner.num_ranks={p['ranks']}", f"trainer.total_steps={s['steps']}",
        "trainer.eval_every=0"])
    rows = training_rows(run["rows"], 1)
    return {**p, "step_s": median(r["time/step_s"] for r in rows),
            "generate_s": median(r.get("time/generate_s", 0.0) for r in rows),
            "learner_s": median(r.get("time/logprobs_s", 0.0) + r.get("time/learn_s", 0.0) for r in rows),
            "tokens_per_step": median(r["tokens_generated"] for r in rows), "command": run["command"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    s = QUICK if args.quick else FULL
    tag = "-quick" if args.quick else ""
    require_model(str(model_path(s["preset"])), s["preset"])
    rollout = rollout_scaling(s)
    base_tps = rollout["1 worker"]["tokens_per_s"]
    print_table(f"scaling: rollout, {s['rollout_prompts']} prompts x G={s['rollout_G']} x {s['rollout_L']} tokens "
                f"({s['preset']})", ["engines", "seconds", "tokens/s", "speedup"],
                [[k, v["seconds"], v["tokens_per_s"], v["tokens_per_s"] / base_tps] for k, v in rollout.items()])
    points = [step_point(s, p, tag) for p in sweep_points(s)]
    rows = [[p["varied"], p["G"], p["L"], p["ranks"], s["P"] * p["G"], p["tokens_per_step"], p["step_s"],
             p["generate_s"], p["learner_s"]] for p in points]
    print_table(f"scaling: fleetrl step time ({s['preset']}, {s['P']} prompts/step, median of {s['steps'] - 1} "
                f"measured steps)", ["varied", "G", "completion len", "learner ranks", "completions/step",
                                     "tokens/step", "s/step", "generate s", "learner s"], rows)
    save_result("scaling", args.quick, {"settings": s, "rollout": rollout, "steps": points})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
