"""Many multi-turn episodes on one in-process vLLM engine, concurrently: one engine request per turn.

Each episode is an asyncio coroutine (:func:`workers.envs.episode.run_episode`) that awaits
:meth:`EngineLoop.generate` for every assistant turn and runs its tools in threads. The loop adds each turn's
request to the engine the moment the episode asks for it and steps the engine while any request is unfinished,
so vLLM's continuous batching batches the turns of all episodes that are waiting for the model; an episode
waiting for a slow tool holds no request and blocks nobody. Between engine steps the event loop runs the
episodes whose tools finished (tools run in threads, so they progress during a step too).

The engine is stepped on the event loop's own thread (vLLM's ``LLMEngine`` is not thread-safe: a request added
from another thread during ``step()`` would race it).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass


@dataclass
class Completion:
    """One assistant turn as the engine sampled it."""

    token_ids: list[int]
    logprobs: list[float]  # the engine's logprob of each sampled token
    text: str
    finish_reason: str  # "stop" (EOS / end-of-turn token or a stop string) or "length"


class EngineLoop:
    def __init__(self, llm, params_for, lora_request=None):
        """``llm``: a ``vllm.LLM``; ``params_for(max_new_tokens, seed[, stop])`` -> the turn's ``SamplingParams``;
        ``lora_request``: the served LoRA adapter every turn samples with (None: the engine's weights)."""
        self.engine = llm.llm_engine
        self.lora_request = lora_request
        self.params_for = params_for
        self.ids = itertools.count()
        self.pending: dict[str, asyncio.Future] = {}
        self.wake = asyncio.Event()
        self.closed = False

    async def generate(self, context_ids: list[int], max_new_tokens: int, seed: int | None,
                       stop: list[str] | None = None) -> Completion:
        """Sample one turn continuing ``context_ids`` (the exact ids so far: prompt, turns, observations);
        ``stop``: more stop strings for this turn (an agent's request)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = self.params_for(max_new_tokens, seed, stop) if stop else self.params_for(max_new_tokens, seed)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        rid = f"turn-{next(self.ids)}"
        future = asyncio.get_running_loop().create_future()
        self.pending[rid] = future
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(context_ids)), params,
                                lora_request=self.lora_request)
        self.wake.set()
        try:
            out = await future
        except asyncio.CancelledError:  # the episode timed out: its request must not run on for nobody
            self.pending.pop(rid, None)
            self.engine.abort_request([rid])
            raise
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        return Completion(ids, [lp[t].logprob for lp, t in zip(comp.logprobs, ids)], comp.text,
                          comp.finish_reason or "length")

    async def run(self) -> None:
        """Step the engine while requests are pending, until :meth:`close`."""
        while not self.closed:
            if not self.pending:
                self.wake.clear()
                await self.wake.wait()
                continue
            for out in self.engine.step():
                future = self.pending.pop(out.request_id, None) if out.finished else None
                if future is not None and not future.done():
                    future.set_result(out)
            await asyncio.sleep(0)  # let episodes whose turn or tool finished go on

    def close(self) -> None:
        self.closed = True
        self.wake.set()


async def run_all(llm, params_for, episodes, lora_request=None) -> list:
    """Run ``episodes`` (callables ``generate -> coroutine``) concurrently on one engine; results in order."""
    loop = EngineLoop(llm, params_for, lora_request)
    driver = asyncio.create_task(loop.run())
    try:
        return await asyncio.gather(*(episode(loop.generate) for episode in episodes))
    finally:
        loop.close()
        await driver
