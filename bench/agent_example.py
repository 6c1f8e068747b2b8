"""Issue 45's example, trained and measured: ``examples/math_agent.py`` (agent code written only against the
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
  (``python -m examples.math_agent``): the user's code on a server that is not fleetrl's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request

import yaml

from bench.common import PY, RUNS_DIR, SUBPROCESS_ENV, parse_args, print_table, run_logged, save_result

BASE = ".fleetrl/models/smollm2-135m-instruct"
AGENT, TOOLS = "configs/smollm2_agent.yaml", "configs/smollm2_tools.yaml"
PORT = 8311


def _extra(ap) -> None:
    ap.add_argument("--sft-steps", type=int, default=3)
    ap.add_argument("--rl-steps", type=int, default=20)
    ap.add_argument("--bf16", action="store_true", help="bf16 engines and learner (fast only with AMX)")
    ap.add_argument("--n", type=int, default=100, help="held-out problems of each check")


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


def against_vllm_serve(label: str, model: str, n: int, dtype: str) -> dict:
    """``vllm serve`` of ``model`` with vLLM's hermes tool parser; ``examples/math_agent.py`` unchanged against it."""
    log = RUNS_DIR / f"agent_example-serve-{label}.log"
    env = {**os.environ, **SUBPROCESS_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [os.path.join(os.path.dirname(PY), "vllm"), "serve", model, "--port", str(PORT), "--served-model-name",
           "policy", "--dtype", dtype, "--max-model-len", "2048", "--enable-auto-tool-choice",
           "--tool-call-parser", "hermes", "--api-key", "bench"]
    with log.open("w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve did not come up; see {log}") from None
                time.sleep(3)
        t0 = time.perf_counter()
        res = subprocess.run([PY, "-m", "examples.math_agent", "--base-url", f"http://127.0.0.1:{PORT}/v1",
                              "--model", "policy", "--api-key", "bench", "--n", str(n)],
                             capture_output=True, text=True, env={**os.environ, **SUBPROCESS_ENV}, timeout=1800)
        if res.returncode:
            raise RuntimeError(f"examples.math_agent failed: {res.stderr[-2000:]}")
        return {**json.loads(res.stdout.strip().splitlines()[-1]), "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, extra=_extra)
    if args.quick:
        args.sft_steps, args.rl_steps, args.n = 1, 1, 8
    tag = "-quick" if args.quick else ""
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    run_dir = RUNS_DIR / f"agent_example{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    path = RUNS_DIR / f"agent_example{tag}.yaml"
    path.write_text(yaml.safe_dump(recipe(args.sft_steps, args.rl_steps), sort_keys=False))
    check = tools_config(RUNS_DIR / f"agent_example{tag}-tools.yaml")
    common = ["rollout.dtype=bfloat16", "learner.mixed_precision=bfloat16"] if args.bf16 else []
    if args.quick:
        common += ["data.eval_size=8"]
    dtype = "bfloat16" if args.bf16 else "float32"
    result = {"settings": vars(args), "recipe": str(path),
              "base": {"outside": outside(f"{tag}base", check, BASE, args.n),
                       "vllm_serve": against_vllm_serve(f"{tag}base", BASE, args.n, dtype)}}
    cmd = [PY, "-m", "orchestrator", "pipeline", "-c", str(path), *common, f"run.dir={run_dir}"]
    result["wall_s"] = round(run_logged(cmd, RUNS_DIR / f"agent_example{tag}.log", 7200), 1)
    result["command"] = " ".join(cmd[1:])
    result["stages"] = json.loads((run_dir / "summary.json").read_text())["stages"]
    for st in result["stages"]:
        st["outside"] = outside(f"{tag}{st['name']}", check, st["model"], args.n)
        st["vllm_serve"] = against_vllm_serve(f"{tag}{st['name']}", st["model"], args.n, dtype)
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
