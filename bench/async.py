"""The rollout modes in a disaggregated layout: ``sync``, ``one_step_off`` and ``async`` (eta = 1, 2, 4) with the
engine and the reward actor on one core and the learner on the other (process affinity), as separate GPU pools
are on a cluster; completion lengths long-tailed like DAPO's. Then the simulator (:mod:`bench.async_sim`)
calibrated on the sync run, beside the measured ratios.

    python -m bench.async [--quick]

The task: ``configs/gen_heavy.yaml``'s random-init ~24 M-param model (fp32, eager engines), 8 prompts x G=8 per
step, completions capped at 128 tokens and stopped at any doubled digit (``11`` ... ``99``): the model samples
nearly uniformly, so a completion stops with probability ~1/40 per token (mean ~35 tokens, a few percent run to
the cap). Its reward is 0: this measures throughput, not learning. One rollout engine (1 thread), one reward actor,
one learner rank (ZeRO-0); every mode gets the same pinning (the driver with the engine), re-applied every 0.5 s
to every thread of the processes.

Per mode (steps after the warm-up): completions/s, the speed-up over sync, the learner's idle share (step time
outside its logprob pass and update), the engine's idle share (sync/one_step_off: step time outside generation;
async: the stream's own idle clock), the trained tokens' staleness and the share of samples that span a push.
"""

from __future__ import annotations

import os
import statistics
import threading

from bench.async_sim import Costs, Workload, simulate
from bench.build_models import model_path
from bench.common import parse_args, print_table, require_model, run_fleetrl, save_result, training_rows

STOP = "[" + ", ".join(f"'{d}{d}'" for d in range(1, 10)) + "]"
MODES = [("sync", ["rollout.mode=sync"]), ("one_step_off", ["rollout.mode=one_step_off"])] + [
    (f"async eta={eta}", ["rollout.mode=async", f"rollout.max_staleness={eta}"]) for eta in (1, 2, 4)]
FULL = dict(preset="gen-heavy", P=8, G=8, L=128, steps=10, skip=2)
QUICK = dict(preset="gen-tiny", P=4, G=4, L=32, steps=3, skip=1)
ROLES = {"ray::RolloutWorker": {0}, "ray::RewardWorker": {0}, "ray::LearnerWorker": {1},
         "orchestrator\x00train": {0}}
"""Process title (or command line) fragment -> cores: the driver (`python -m orchestrator train`, which polls the
streams in async mode) goes with the engine and the reward actor, so the learner has its core to itself."""


def pin(stop: threading.Event, roles: dict[str, set[int]]) -> None:
    """Every thread of each actor process whose title names a role onto that role's cores, until ``stop``."""
    while not stop.is_set():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                title = open(f"/proc/{pid}/cmdline", "rb").read()
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            cores = next((c for name, c in roles.items() if name.encode() in title), None)
            for tid in tids if cores else []:
                try:
                    os.sched_setaffinity(int(tid), cores)
                except OSError:
                    pass
        stop.wait(0.5)


def overrides(case: dict) -> list[str]:
    model = str(model_path(case["preset"]))
    return [f"model.path={model}", f"data.prompts_per_step={case['P']}", f"rollout.group_size={case['G']}",
            f"rollout.max_new_tokens={case['L']}", f"rollout.stop={STOP}", "rollout.num_workers=1",
            "rollout.cpu_threads=1", "rollout.dtype=float32", "rollout.enforce_eager=true", "reward.num_workers=1",
            "learner.num_ranks=1", "learner.zero_stage=0", "learner.mixed_precision=null", "learner.micro_batch_size=8",
            f"trainer.total_steps={case['steps']}", "trainer.eval_every=0", "run.dump_rollouts=true"]


def summarize(name: str, rows: list[dict], skip: int) -> dict:
    train = training_rows(rows, skip)
    wall = sum(r["time/step_s"] for r in train)
    learner = sum(r.get("time/learn_s", 0.0) + r.get("time/logprobs_s", 0.0) for r in train)
    if name.startswith("async"):
        engine_idle = statistics.mean(r["async/engine_idle_frac"] for r in train)
    else:
        gen = sum(r.get("time/generate_s", 0.0) + r.get("time/generate_overlapped_s", 0.0) for r in train)
        engine_idle = max(0.0, 1 - gen / wall)
    return {"completions_per_s": sum(r["rollout/samples"] for r in train) / wall, "step_s": wall / len(train),
            "learner_idle": max(0.0, 1 - learner / wall), "engine_idle": engine_idle,
            "staleness_max": max(r.get("async/staleness_max", r["rollout/staleness_max"]) for r in train),
            "partial_frac": statistics.mean(r.get("async/partial_frac", 0.0) for r in train),
            "dropped": train[-1].get("async/dropped_stale", 0),
            "length_mean": statistics.mean(r["response/length_mean"] for r in train),
            "truncated_frac": statistics.mean(r["response/truncated_frac"] for r in train)}


def calibrate(sync_rows: list[dict], case: dict, skip: int) -> tuple[Costs, float]:
    """The simulator's costs from the sync run: a decode step's cost from the generation time and tokens
    (fixed part 0), the learner's per-token cost from its update time, the push from the sync time."""
    train = training_rows(sync_rows, skip)
    tokens = statistics.mean(r["tokens_generated"] for r in train)
    gen_s = statistics.mean(r["time/generate_s"] for r in train)
    seqs = case["P"] * case["G"]
    # with all seqs decoding together for ~mean-length steps then a tail: per_seq cost from tokens generated
    per_seq = gen_s / tokens
    learn_s = statistics.mean(r["time/learn_s"] + r.get("time/logprobs_s", 0.0) for r in train)
    push_s = statistics.mean(r["time/sync_s"] for r in train)
    costs = Costs(engines=1, max_seqs=seqs * 8, step_s=0.0, per_seq_s=per_seq, train_s=0.0,
                  per_token_s=learn_s / tokens, push_s=push_s)
    return costs, tokens / seqs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    case = QUICK if args.quick else FULL
    require_model(str(model_path(case["preset"])), case["preset"])
    stop = threading.Event()
    threading.Thread(target=pin, args=(stop, ROLES), daemon=True).start()
    measured, rows_by_mode = {}, {}
    try:
        for name, extra in MODES:
            run = run_fleetrl(f"async-{name.replace(' ', '_').replace('=', '')}", "configs/gen_heavy.yaml",
                              overrides(case) + extra)
            rows_by_mode[name] = run["rows"]
            measured[name] = summarize(name, run["rows"], case["skip"])
    finally:
        stop.set()
    base = measured["sync"]["completions_per_s"]
    table = [[name, f"{m['completions_per_s']:.2f}", f"{m['completions_per_s'] / base:.2f}x",
              f"{m['step_s']:.2f}", f"{m['engine_idle']:.2f}", f"{m['learner_idle']:.2f}", m["staleness_max"],
              f"{m['partial_frac']:.2f}", m["dropped"]] for name, m in measured.items()]
    headers = ["mode", "completions/s", "x sync", "s/step", "engine idle", "learner idle", "staleness max",
               "partial", "dropped groups"]
    print_table("disaggregated: engine + reward on core 0, learner on core 1", headers, table)
    costs, mean_len = calibrate(rows_by_mode["sync"], case, case["skip"])
    sim = simulated(costs, case)
    print_table("the simulator calibrated on the sync run (same workload)", ["mode", "x sync (simulated)",
                "x sync (measured)"], [[k, f"{v:.2f}x", f"{measured[k]['completions_per_s'] / base:.2f}x"]
                                       for k, v in sim.items()])
    save_result("async", args.quick, {"case": case, "stop": STOP, "measured": measured, "simulated_x_sync": sim,
                                      "calibrated_costs": costs.__dict__, "mean_length": mean_len})


def simulated(costs: Costs, case: dict) -> dict:
    """Speed-up over sync per mode from :func:`bench.async_sim.simulate` with the measured lengths' law."""
    import random

    def lengths(rng: random.Random) -> int:  # a stop with probability 1/40 per token, capped
        n = 1
        while n < case["L"] and rng.random() > 1 / 40:
            n += 1
        return n

    work = Workload(case["P"], case["G"], lengths, steps=40)
    runs = {"sync": simulate("sync", costs, work), "one_step_off": simulate("one_step_off", costs, work)}
    runs.update({f"async eta={eta}": simulate("async", costs, work, eta) for eta in (1, 2, 4)})
    base = runs["sync"].completions_per_s
    return {k: r.completions_per_s / base for k, r in runs.items()}


if __name__ == "__main__":
    main()
