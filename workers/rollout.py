"""`rollout-i` Ray actors: each owns one vLLM ``LLM`` engine in-process.

``generate`` takes prompts and returns G :class:`Sample` per prompt with token ids, per-token logprobs and
the policy version of the weights that produced them. ``load_weights`` reloads the engine in place from
weight buckets (:mod:`workers.weight_buckets`) in Ray's object store (see :mod:`workers.vllm_ext`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from common.actor_logs import LoggedActor
from common.imports import skip_unused_imports
from workers.prompts import PromptRenderer, use_chat_template
from workers.records import Sample, StreamTake

ENGINE_CALL_S = 3600.0
"""How long a call that needs the engine (an eval's generation, a weight push, a judge's logprobs) may wait for a
streaming engine's thread to run it, before the call fails naming what it waited for."""

CPU_ENV = {
    # one engine per actor, in-process (no engine-core subprocess inside a Ray worker)
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # actors share the machine's cores: don't let each engine pin all of them
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class EngineSpec:
    """What one vLLM engine serves and how: the typed record the driver sends a `rollout-i` (or `judge-i`) actor
    (:func:`orchestrator.rl.specs.engine_spec` builds it from the config). ``enforce_eager`` None: eager on CPU.
    ``partial_push``: pushes carry only some layers (LoRA's merged push), the rest keep their tensors. ``lora``
    (:meth:`LoraSection.engine_spec`): serve the policy as base + the pushed LoRA adapter. ``stop``: strings that
    end every completion (kept in its text), besides the model's end-of-turn tokens."""

    model_path: str
    dtype: str
    max_model_len: int
    kv_cache_gib: float
    seed: int
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    enforce_eager: bool | None = None
    prompt_format: str = "auto"
    system_prompt: str | None = None
    chat_template: str | None = None  # data.chat_template's text (read on the driver), None: the tokenizer's
    chat_template_kwargs: dict | None = None
    stop: tuple[str, ...] = ()
    partial_push: bool = False
    lora: dict | None = None
    trust_remote_code: bool = False


class RolloutWorker(LoggedActor):
    """Plain class; the orchestrator wraps it with ``ray.remote`` and names it ``rollout-i``."""

    def __init__(self, spec: EngineSpec):
        self._start_logging()
        skip_unused_imports()
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
        self._build(spec)

    def _build(self, spec: EngineSpec) -> None:
        """The engine of ``spec`` and everything that serves it, as a new actor has them."""
        from vllm import LLM

        lora, max_model_len = spec.lora, spec.max_model_len
        kwargs = dict(
            model=spec.model_path, dtype=spec.dtype, seed=spec.seed, max_model_len=max_model_len,
            enforce_eager=_on_cpu() if spec.enforce_eager is None else spec.enforce_eager,
            tensor_parallel_size=spec.tensor_parallel_size, max_num_seqs=spec.max_num_seqs,
            worker_extension_cls="workers.nccl_sync.NcclWeightSyncExtension", enable_prefix_caching=True,
            # logprobs of the distribution actually sampled (after temperature), as the learner computes them
            logprobs_mode="processed_logprobs", trust_remote_code=spec.trust_remote_code,
        )
        if lora:
            from workers.lora_adapters import engine_kwargs

            kwargs.update(engine_kwargs(lora))
        if _on_cpu():
            _allow_amx()
            kwargs["kv_cache_memory_bytes"] = int(spec.kv_cache_gib * 2**30)
            # whole prompts only: vLLM's CPU runner crashes ("CPU Generator does not use offset") when a seeded
            # request's prefill is split across steps, which happens once a call's new prompt tokens pass the
            # 4096-token step budget (long multi-turn contexts, Constitutional AI's critique turns)
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
        else:
            kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
        self.llm = LLM(**kwargs)
        self.max_model_len = max_model_len
        if spec.partial_push:
            self.llm.collective_rpc("fleetrl_expect_partial_push")
        self.adapter = None  # the served LoRA adapter (learner.lora.push: adapter)
        if lora:
            from workers.lora_adapters import ServedAdapter

            self.adapter = ServedAdapter(self.llm, lora, str(os.getpid()))
        self._warm_up()
        self.tokenizer = use_chat_template(self.llm.get_tokenizer(), spec.chat_template)
        self.renderer = PromptRenderer(self.tokenizer, spec.prompt_format, spec.system_prompt,
                                       spec.chat_template_kwargs)
        self.stop = list(spec.stop)
        self.policy_version = 0
        self.generated_tokens = 0
        self.episodes = None  # EpisodeFactory of the env config last used (run_episodes)
        self.service = None  # the generation stream (stream_start), None while generating call by call
        self.streamed: dict[str, tuple] = {}  # a streamed request's uid -> (prompt uid, index, text, metadata)

    def rebuild(self, spec: EngineSpec, threads: int) -> float:
        """Replace this actor's engine by one of ``spec`` on ``threads`` torch threads, in this process (CPU
        engines; see :meth:`orchestrator.rl.fleet.Fleet.serve`): what a new actor would serve, without a new
        process's start and imports (about 20 s of an engine's start on 2 cores, against 2-4 s here). The old
        engine is shut down and its distributed state torn down first, as vLLM's own tests do between engines in
        one process. Its seconds."""
        import gc

        import torch
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        t0 = time.perf_counter()
        self.stream_stop()
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = self.adapter = self.episodes = None
        gc.collect()
        cleanup_dist_env_and_memory()
        # vLLM's CPU worker replaces torch.set_num_threads by a no-op (it binds threads once); with
        # VLLM_CPU_OMP_THREADS_BIND=nobind nothing is bound, and torch's own setter sets the OpenMP pool
        torch._C.set_num_threads(threads)
        self._build(spec)
        return time.perf_counter() - t0

    def _warm_up(self) -> None:
        """One 2-token request with logprobs: vLLM compiles its logprob gather on first use (about 2 s on 2 cores),
        which would otherwise land on the first eval or step instead of the start-up that runs beside the learner's."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=2, logprobs=0),
                          use_tqdm=False)

    def generate(self, prompts: list[tuple[str, str | list[dict], dict]], group_size: int, max_new_tokens: int,
                 temperature: float, top_p: float, seed: int | None, prefixes: list[list[int]] | None = None,
                 stop: list[str] | None = None) -> list[Sample]:
        """``prompts`` are (uid, prompt, metadata), the prompt a string or chat messages, rendered by
        :class:`PromptRenderer`. Returns ``len(prompts) * group_size`` samples, grouped by prompt. Generation stops
        at the model's EOS / end-of-turn tokens (kept as the last completion token) or a ``stop`` string (kept in
        the text). ``temperature == 0`` is greedy. Each sample gets its own seed derived from ``seed`` so results
        do not depend on how prompts are spread over workers.

        ``prefixes[i]``: token ids that continue prompt i's rendered ids (a partial solution being extended: step
        labels, step-level search); the sample's prompt is the prompt and its prefix, its completion what follows.
        ``stop``: more stop strings for this call (one step: the step separator).

        While streaming (:meth:`stream_start`) the call runs on the stream's thread with the stream paused (its
        unfinished samples resubmitted afterwards with their tokens so far): evals and the weight-sync probe of a
        fully asynchronous run lose no streamed token."""
        args = (prompts, group_size, max_new_tokens, temperature, top_p, seed, prefixes, stop)
        return self._on_engine(lambda: self._generate(*args), "generate")

    def _on_engine(self, fn, what: str, timeout: float = ENGINE_CALL_S):
        """``fn()``, which uses the engine: at once, or while streaming on the stream's thread with the stream
        paused (the engine is not thread-safe; :meth:`workers.stream.Stream.paused`)."""
        if self.service is None:
            return fn()
        stream = self.service.stream
        return self.service.call(lambda: stream.paused(fn), f"{self.name}: {what}", timeout)

    def _generate(self, prompts, group_size, max_new_tokens, temperature, top_p, seed, prefixes, stop) -> list[Sample]:
        from vllm.inputs import TokensPrompt

        requests, params, texts = [], [], []
        stops = (self.stop + list(stop or [])) or None
        for i, (uid, prompt, _) in enumerate(prompts):
            text, ids = self.renderer.render(prompt)
            if prefixes is not None and prefixes[i]:
                ids = ids + list(prefixes[i])
                text += self.tokenizer.decode(prefixes[i])
            texts.append(text)
            for j in range(group_size):
                requests.append(TokensPrompt(prompt_token_ids=ids))
                params.append(_sampling(temperature, top_p, max_new_tokens,
                                        None if seed is None else _sample_seed(seed, uid, j), stops))
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request())
        samples = []
        for k, out in enumerate(outputs):
            uid, _, meta = prompts[k // group_size]
            text = texts[k // group_size]
            comp = out.outputs[0]
            token_ids = list(comp.token_ids)
            logprobs = [lp[t].logprob for lp, t in zip(comp.logprobs, token_ids)]
            samples.append(Sample(
                prompt_uid=uid, sample_index=k % group_size, prompt_text=text, prompt_ids=list(out.prompt_token_ids),
                completion_ids=token_ids, logprobs=logprobs, completion_text=comp.text,
                finish_reason=comp.finish_reason or "length", policy_version=self.policy_version, metadata=meta,
                worker=self.name,
            ))
            self.generated_tokens += len(token_ids)
        return samples

    def option_logprobs(self, prompts: list[list[dict]], prefix: str,
                        option_ids: list[int]) -> list[list[float] | None]:
        """For each chat prompt: ``log p(option | prompt, prefix)`` of every option token id, where the prompt is
        rendered with the chat template and its generation prompt and ``prefix`` starts the reply (a judge's
        "The answer is: ("). Read from vLLM's prompt logprobs of ``prompt + prefix + option`` (one request per
        option; prefix caching shares the rest), at temperature 1: the model's own distribution. None for a prompt
        that does not fit the engine's context (the caller counts it; the others are still answered)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        head = self.tokenizer(prefix, add_special_tokens=False)["input_ids"]
        ids = [self.renderer.render(p)[1] + head for p in prompts]
        fits = [len(x) + 1 < self.max_model_len for x in ids]
        requests = [TokensPrompt(prompt_token_ids=x + [o]) for x, ok in zip(ids, fits) if ok for o in option_ids]
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        outputs = self._on_engine(lambda: self.llm.generate(requests, params, use_tqdm=False,
                                                            lora_request=self._lora_request()),
                                  "option_logprobs") if requests else []
        logps = iter(out.prompt_logprobs[-1][out.prompt_token_ids[-1]].logprob for out in outputs)
        return [[next(logps) for _ in option_ids] if ok else None for ok in fits]

    def token_logprobs(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """For each (prompt ids, completion ids): this engine's model's logprob of every completion token given
        everything before it, at temperature 1 (vLLM's prompt logprobs of the whole sequence; a teacher scoring a
        student's samples). A sequence longer than the engine's context is an error naming its length."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for prompt, completion in sequences:
            if len(prompt) + len(completion) + 1 > self.max_model_len:
                raise ValueError(f"{self.name}: a sequence of {len(prompt)} prompt + {len(completion)} completion "
                                 f"tokens does not fit the engine's context ({self.max_model_len} tokens)")
        requests = [TokensPrompt(prompt_token_ids=list(p) + list(c)) for p, c in sequences]
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        outputs = self._on_engine(lambda: self.llm.generate(requests, params, use_tqdm=False,
                                                            lora_request=self._lora_request()), "token_logprobs")
        return [[out.prompt_logprobs[len(p) + k][t].logprob for k, t in enumerate(c)]
                for out, (p, c) in zip(outputs, sequences)]

    def run_episodes(self, prompts: list[tuple[str, str | list[dict], dict]], group_size: int, env: dict,
                     max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
                     env_actors: list | None = None) -> list[Sample]:
        """``group_size`` multi-turn episodes per prompt (``env``: the config's ``env`` section), all running
        concurrently on this engine, one request per turn (:mod:`workers.engine_loop`); samples grouped by prompt
        like :meth:`generate`'s. ``env_actors``: the ``env-i`` actors hosting the environments (else they live
        here). Each episode's turns get seeds derived from ``seed``, its prompt and index."""
        import asyncio

        from workers.engine_loop import run_all

        factory = self._factory(env, max_new_tokens, env_actors)

        def params_for(max_tokens: int, turn_seed: int | None, stop: list[str] | None = None):
            stops = factory.renderer.stop + self.stop + list(stop or [])
            return _sampling(temperature, top_p, max_tokens, turn_seed, stops or None)

        async def play(episodes):
            async with factory.serving(temperature, top_p):
                return await run_all(self.llm, params_for, episodes, self._lora_request())

        def turn_seeds(uid: str, j: int):
            return lambda turn: None if seed is None else _sample_seed(seed + 7919 * turn, uid, j)

        jobs = [(uid, j, meta, factory.episode(prompt, meta, _sample_seed(seed or 0, uid, j), turn_seeds(uid, j)))
                for uid, prompt, meta in prompts for j in range(group_size)]
        episodes = asyncio.run(play([job[3] for job in jobs]))
        samples = [factory.to_sample(ep, uid, j, meta, self.policy_version, self.name)
                   for (uid, j, meta, _), ep in zip(jobs, episodes)]
        self.generated_tokens += sum(sum(s.loss_mask) for s in samples)
        return samples

    def _factory(self, env: dict, max_new_tokens: int, env_actors: list | None):
        """The :class:`EpisodeFactory` of ``env`` (kept while the env config and its actors stay the same)."""
        from workers.episodes import EpisodeFactory

        if self.episodes is None or self.episodes.env != env or self.episodes.env_actors != list(env_actors or []):
            self.episodes = EpisodeFactory(env, self.tokenizer, max_new_tokens, env_actors, self.name,
                                           lambda: self.policy_version)
        return self.episodes

    def agent_address(self, env: dict, max_new_tokens: int) -> dict:
        """Where agents outside the fleet (``env.agent: external``) reach this actor's endpoint for ``env``:
        ``{"worker", "url", "token"}``; a wildcard ``env.endpoint_host`` is advertised as the node's IP."""
        address = self._factory(env, max_new_tokens, None).agent.endpoint.address()
        if env.get("endpoint_host") in ("0.0.0.0", "::", ""):
            import ray
            from ray._common.network_utils import node_ip_address_from_perspective

            port, ip = address["url"].rsplit(":", 1)[1], ray.util.get_node_ip_address()
            if ip.startswith("127."):  # a private Ray instance is on loopback; the endpoint is asked to be reachable
                ip = node_ip_address_from_perspective()
            address["url"] = f"http://{ip}:{port}"
        return {"worker": self.name, **address}

    def stream_start(self, temperature: float, top_p: float) -> None:
        """Generate on the engine's own thread from now on (:mod:`workers.stream`): samples submitted with
        :meth:`stream_submit` come back from :meth:`stream_take` as they finish, and a weight push lands between
        two engine steps, resubmitting the unfinished samples with their tokens so far (partial rollouts)."""

        from workers.stream import Stream, StreamService

        if self.service is not None:  # a stream a failed run left behind: its requests are not this run's
            with contextlib.suppress(Exception):
                self.stream_stop()

        def params_for(max_tokens: int, seed: int | None):
            return _sampling(temperature, top_p, max_tokens, seed, self.stop or None)

        stream = Stream(self.llm.llm_engine, params_for, self.policy_version, self._lora_request)
        self.service = StreamService(stream, self._streamed_sample)

    def stream_submit(self, prompts: list[tuple[str, str | list[dict], dict]], group_size: int, max_new_tokens: int,
                      seeds: list[int | None]) -> int:
        """Queue ``group_size`` samples of each (uid, prompt, metadata), sample j of prompt i seeded as
        :meth:`generate` seeds it with ``seeds[i]``."""
        items = []
        for (uid, prompt, meta), seed in zip(prompts, seeds, strict=True):
            text, ids = self.renderer.render(prompt)
            for j in range(group_size):
                self.streamed[f"{uid}/{j}"] = (uid, j, text, meta)
                items.append((f"{uid}/{j}", ids, max_new_tokens, None if seed is None else _sample_seed(seed, uid, j)))
        stream = self.service.stream
        self.service.call(lambda: [stream.submit(*item) for item in items], "stream_submit")
        return len(items)

    def stream_take(self) -> StreamTake:
        """The streamed samples finished since the last call, and the stream's state."""
        samples = self.service.take()
        return StreamTake(samples, self.service.stream.in_flight, self.service.idle_s, self.policy_version)

    def stream_stop(self) -> int:
        """Back to call-by-call generation; the unfinished samples are dropped (their number is returned)."""
        if self.service is None:
            return 0
        service, self.service = self.service, None
        try:
            return service.call(service.stream.abort_all, "stream_stop")
        finally:  # detached even when the stream thread died or did not answer
            service.close()
            if not service.thread.is_alive():
                service.stream.abort_all()  # what a thread that died left in the engine (none after the call)
            # only now: a sample that finishes in the steps before the abort still finds its entry (cleared
            # first, its KeyError ended the stream's thread and left its requests in the engine)
            self.streamed = {}

    def _streamed_sample(self, p) -> Sample:
        uid, j, text, meta = self.streamed.pop(p.uid)
        self.generated_tokens += len(p.token_ids)
        return Sample(
            prompt_uid=uid, sample_index=j, prompt_text=text, prompt_ids=p.prompt_ids, completion_ids=p.token_ids,
            logprobs=p.logprobs, completion_text=self.tokenizer.decode(p.token_ids, skip_special_tokens=True),
            finish_reason=p.finish_reason, policy_version=min(p.versions, default=self.policy_version),
            metadata=meta, worker=self.name, token_versions=p.versions)

    def _reload(self, load, version: int) -> int:
        """``load()`` (the tensors it loaded) and a reset prefix cache, at ``version``: at once, or while streaming
        between two engine steps with the unfinished samples resubmitted."""
        def apply():
            n = load()
            self.llm.reset_prefix_cache()
            return n

        if self.service is None:
            loaded = apply()
        else:
            stream = self.service.stream
            loaded = self.service.call(lambda: stream.push(apply, version)["loaded"], f"weight push v{version}",
                                       ENGINE_CALL_S)
        self.policy_version = version
        return loaded

    def load_weights(self, bucket_refs: list, version: int) -> dict:
        """Reload the engine in place from packed buckets (ObjectRefs of :class:`Bucket`), fetched one at a time."""
        import ray

        from workers.weight_buckets import from_object

        t0 = time.perf_counter()

        def stream() -> Iterator:
            for ref in bucket_refs:
                yield from from_object(ray.get(ref))

        def load() -> int:
            if self.adapter is not None:
                return self.adapter.load(stream(), version)
            return self.llm.collective_rpc("fleetrl_reload_weights", args=(stream(),))[0]

        return {"tensors": self._reload(load, version), "seconds": time.perf_counter() - t0, "version": version}

    def load_model_weights(self, path: str) -> dict:
        """Reload the engine in place from the model directory ``path`` (its ``*.safetensors`` files, read one
        tensor at a time): a fleet that serves a run without a learner gets the run's model into kept engines
        this way instead of starting new ones. The policy version is 0 again."""
        from safetensors import safe_open

        t0 = time.perf_counter()

        def stream() -> Iterator:
            for file in sorted(Path(path).glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as weights:
                    for name in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                        yield name, weights.get_tensor(name)

        loaded = self._reload(lambda: self.llm.collective_rpc("fleetrl_reload_weights", args=(stream(),))[0], 0)
        return {"tensors": loaded, "seconds": time.perf_counter() - t0, "version": 0}

    def join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                          timeout_s: float | None = None) -> list[int]:
        """Every worker of this engine joins the learner's weight group (see :mod:`workers.nccl_sync`)."""
        return self._on_engine(lambda: self.llm.collective_rpc(
            "fleetrl_init_weight_group", args=(host, port, rank_offset, world_size, backend, timeout_s)),
            "join_weight_group")

    def receive_weights(self, plans: list, version: int) -> dict:
        """Receive one collective push (learner rank 0 broadcasts) and reload the engine in place."""
        t0 = time.perf_counter()

        def load() -> int:
            if self.adapter is not None:
                return self.adapter.load(self.llm.collective_rpc("fleetrl_receive_tensors", args=(plans,))[0],
                                         version)
            return self.llm.collective_rpc("fleetrl_receive_weights", args=(plans,))[0]

        return {"tensors": self._reload(load, version), "seconds": time.perf_counter() - t0, "version": version}

    def _lora_request(self):
        """The served adapter's ``LoRARequest`` (None: the engine's own weights are the policy)."""
        return self.adapter.request if self.adapter is not None else None

    def engine_weights(self) -> dict:
        """The engine's parameters under vLLM's names (see ``fleetrl_named_weights``), from its first worker."""
        return self._on_engine(lambda: self.llm.collective_rpc("fleetrl_named_weights")[0], "engine_weights")

    def push_checksums(self) -> dict:
        """Per-tensor checksums of what the last push delivered (``fleetrl_push_checksums``), from the first worker."""
        return self._on_engine(lambda: self.llm.collective_rpc("fleetrl_push_checksums")[0], "push_checksums")

    def stats(self) -> dict:
        import torch

        return {"policy_version": self.policy_version, "generated_tokens": self.generated_tokens, "pid": os.getpid(),
                "threads": torch.get_num_threads()}


def _sampling(temperature: float, top_p: float, max_tokens: int, seed: int | None, stop: list[str] | None):
    """One sample's ``SamplingParams``: the sampled tokens' logprobs, stop strings kept in the text."""
    from vllm import SamplingParams

    return SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0, seed=seed,
                          stop=stop, include_stop_str_in_output=True)


def _sample_seed(seed: int, uid: str, j: int) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(f"{uid}/{j}".encode())) % (2**31 - 1)


def _allow_amx() -> None:
    """Ask Linux for the AMX tile state before the engine runs: vLLM's CPU attention picks its AMX kernels for
    bf16 when the CPU has AMX (``torch.cpu._is_amx_tile_supported``) but never requests the tile-data permission
    (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), so its first bf16 forward dies with SIGILL on AMX machines (Sapphire and
    Emerald Rapids). torch's ``_init_amx`` makes that request; a no-op where AMX is absent."""
    import torch

    if torch.cpu._is_amx_tile_supported() and not torch._C._cpu._init_amx():
        raise RuntimeError("this CPU reports AMX but Linux refused its tile state (arch_prctl ARCH_REQ_XCOMP_PERM); "
                           "bf16 engines would die with SIGILL: use rollout.dtype=float32")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
