"""An agent that runs outside the fleet (another process, container or machine) and trains with it
(``env.agent: external``): it claims tasks from the rollout actors' endpoints, runs the same agent code as
``examples/math_agent.py`` against the ``base_url`` it gets, and finishes each session with its reward.

    fleetrl train -c configs/smollm2_agent.yaml env.agent=external run.dir=runs/ext &
    python -m examples.external_agent runs/ext [--concurrency 16]

The run writes its endpoints (address and token of every rollout actor) to ``<run.dir>/agent_endpoints.json``
before each generation call; this loop reads it again when an endpoint stops answering (between calls the
endpoints are down: wait; a replaced actor has a new address). The run removes the file when it ends: this loop
stops then, when the final model appears, or after ``--idle-s`` without a task.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import openai

from examples.math_agent import solve


def endpoints(run_dir: Path) -> list[dict]:
    path = run_dir / "agent_endpoints.json"
    return json.loads(path.read_text())["endpoints"] if path.exists() else []


async def claim(http: httpx.AsyncClient, endpoint: dict, wait_s: float = 2.0) -> dict | None:
    """A waiting task of ``endpoint`` (``{"session_id", "task", "base_url", "model"}``), or None."""
    reply = await http.post(f"{endpoint['url']}/v1/sessions", json={"wait_s": wait_s},
                            headers={"Authorization": f"Bearer {endpoint['token']}"}, timeout=wait_s + 10)
    reply.raise_for_status()
    return None if reply.status_code == 204 else reply.json()


async def run_one(http: httpx.AsyncClient, endpoint: dict, claimed: dict) -> float:
    """The agent on one claimed task; the session finished with its reward (0.0 when the agent failed)."""
    client = openai.AsyncOpenAI(base_url=claimed["base_url"], api_key=endpoint["token"],
                                http_client=openai.DefaultAsyncHttpxClient(trust_env=False))
    try:
        reward = await solve(client, claimed["task"], model=claimed["model"])
    except openai.APIError:  # the run moved on (the session timed out) or the actor went away
        reward = 0.0
    finally:
        await client.close()
    await http.post(f"{endpoint['url']}/sessions/{claimed['session_id']}/finish", json={"reward": reward},
                    headers={"Authorization": f"Bearer {endpoint['token']}"})
    return reward


async def worker(run_dir: Path, http: httpx.AsyncClient, index: int, idle_s: float, stats: dict) -> None:
    last, seen = time.monotonic(), False
    while time.monotonic() - last < idle_s and not (run_dir / "final").exists():
        found = endpoints(run_dir)
        if not found and seen:  # the run ended (it removes the file)
            return
        seen = seen or bool(found)
        if not found:
            await asyncio.sleep(1.0)
            continue
        endpoint = found[(index + stats["runs"]) % len(found)]
        try:
            claimed = await claim(http, endpoint)
        except httpx.HTTPError:  # between calls the endpoints are down; the file is rewritten before the next
            await asyncio.sleep(1.0)
            continue
        if claimed is None:
            continue
        last = time.monotonic()
        stats["runs"] += 1
        stats["reward"] += await run_one(http, endpoint, claimed)


async def main_async(run_dir: Path, concurrency: int, idle_s: float) -> dict:
    stats = {"runs": 0, "reward": 0.0}
    async with httpx.AsyncClient(trust_env=False) as http:
        await asyncio.gather(*(worker(run_dir, http, i, idle_s, stats) for i in range(concurrency)))
    return stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--idle-s", type=float, default=120.0)
    args = ap.parse_args(argv)
    stats = asyncio.run(main_async(args.run_dir, args.concurrency, args.idle_s))
    print(f"{stats['runs']} sessions, mean reward {stats['reward'] / max(stats['runs'], 1):.3f}")


if __name__ == "__main__":
    main()
