"""Typed handles over groups of Ray actors: the driver calls methods, these decide how a call is split over
the group and gathered back (the role of verl's dispatch modes, written out as ordinary methods)."""

from __future__ import annotations

import contextlib
import logging
import math
import time

import ray

from orchestrator.config import FleetConfig
from orchestrator.rl.specs import (
    engine_spec,
    engine_threads,
    env_spec,
    learner_temperature,
    log_env,
)
from orchestrator.telemetry.console import actor_failed, actor_label, remember_actor
from rewards.reward_model import RewardModelWorker
from rewards.tasks import Prompt
from rewards.worker import RewardWorker
from workers.records import Sample, ScoredSample
from workers.rollout import CPU_ENV, RolloutWorker

log = logging.getLogger("fleetrl")


def _chunks(items: list, n: int) -> list[list]:
    """Split into ``n`` contiguous nearly equal parts (some may be empty)."""
    k, r = divmod(len(items), n)
    out, i = [], 0
    for j in range(n):
        size = k + (j < r)
        out.append(items[i: i + size])
        i += size
    return out


class ActorPool:
    """Workers of one role, spread over the cluster. A worker that dies mid-call is replaced and its share of
    the call re-run, up to ``max_restarts`` times per run (``faults/<role>_restarts`` counts them)."""

    role = "actor"

    def __init__(self, count: int, max_restarts: int):
        self.max_restarts = max_restarts
        self.restarts = 0
        self.recovery_s = 0.0  # seconds the last replacement took (spawn + weights)
        self.workers = [self._spawn_named(i, "") for i in range(count)]

    def _spawn(self, index: int, name: str):
        raise NotImplementedError

    def restart(self, index: int, error: Exception) -> None:
        if self.restarts >= self.max_restarts:
            raise RuntimeError(f"{actor_label(self.workers[index]) or f'{self.role}-{index}'} died and the restart "
                               f"budget ({self.max_restarts}) is spent: {error}") from error
        self.restarts += 1
        t0 = time.perf_counter()
        log.warning("%s died (%s); restarting it (%d/%d)", actor_label(self.workers[index]) or f"{self.role}-{index}",
                    type(error).__name__, self.restarts, self.max_restarts)
        with contextlib.suppress(Exception):
            ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self._spawn_named(index, f"r{self.restarts}")
        self._after_restart(self.workers[index])
        self.recovery_s = time.perf_counter() - t0
        log.warning("%s-%d replaced in %.1fs", self.role, index, self.recovery_s)

    def _spawn_named(self, index: int, suffix: str):
        name = f"{self.role}-{index}"
        try:
            handle = self._spawn(index, name)
        except ValueError:  # a dead actor's name is not released yet
            name = f"{name}-{suffix}"
            handle = self._spawn(index, name)
        remember_actor(handle, name, self.cfg.run.dir)
        return handle

    def _options(self, name: str, env: dict | None = None) -> dict:
        """Ray options every actor of the pool gets: its name, and the environment that sends its output to
        ``<run.dir>/logs/<name>.log``."""
        return {"name": name, "scheduling_strategy": "SPREAD",
                "runtime_env": {"env_vars": {**(env or {}), **log_env(self.cfg)}}}

    def _after_restart(self, worker) -> None:
        pass

    def _after_removal(self) -> None:
        pass

    def ready(self) -> list:
        """ObjectRefs that resolve once every worker's constructor has finished (see :func:`wait_ready`)."""
        return [w.ready.remote() for w in self.workers]

    def handles(self) -> list:
        """Every actor of the pool (a reward pool's reward-model actors are a pool of their own)."""
        return list(self.workers)

    def resize(self, count: int) -> None:
        """Grow or shrink the pool to ``count`` workers. Called between calls (nothing is in flight), so no
        work is lost or done twice; a new worker is made ready (e.g. gets the current weights) before it is
        used. Resource requests are plain Ray requests: on an autoscaling cluster they add nodes."""
        if count < 1:
            raise ValueError(f"a {self.role} pool needs at least 1 worker, got {count}")
        t0 = time.perf_counter()
        before = len(self.workers)
        while len(self.workers) > count:
            ray.kill(self.workers.pop(), no_restart=True)
            self._after_removal()
        new = [self._spawn_named(i, f"s{time.monotonic_ns()}") for i in range(len(self.workers), count)]
        for w in new:
            self._after_restart(w)
        self.workers.extend(new)
        if count != before:
            log.info("%s pool resized %d -> %d in %.1fs", self.role, before, count, time.perf_counter() - t0)

    def fan_out(self, call, parts: list) -> list:
        """``call(worker, part)`` -> ObjectRef on every worker with a non-empty part; results in part order. A worker
        that died on the way (:data:`DIED`) is replaced and its part sent again; one that raised is named."""
        refs = {i: call(self.workers[i], p) for i, p in enumerate(parts) if p}
        out = {}
        while refs:
            i, ref = next(iter(refs.items()))
            try:
                out[i] = ray.get(ref)
            except DIED as e:
                self.restart(i, e)
                refs[i] = call(self.workers[i], parts[i])
                continue
            except ray.exceptions.RayTaskError as e:  # the actor's method raised: name it and its log
                raise actor_failed(self.workers[i], e) from e
            del refs[i]
        return [out[i] for i in sorted(out)]


DIED = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError, ray.exceptions.WorkerCrashedError)
"""What a call on a dead actor raises (Ray's memory monitor's kill is an ``OutOfMemoryError``)."""


AGENT_ENDPOINTS = "agent_endpoints.json"
"""Where in ``run.dir`` the endpoints of ``env.agent: external`` are published (0600, removed at the run's end)."""


class RolloutPool(ActorPool):
    """The `rollout-i` actors. ``generate`` spreads prompts over workers and keeps prompt order; a replaced
    worker gets the current weights before it receives prompts."""

    role = "rollout"

    def __init__(self, cfg: FleetConfig, max_model_len: int, current_weights=None, envs: EnvPool | None = None):
        """``current_weights``: a callable giving the learner's current weights as bucket ObjectRefs (see
        :meth:`~orchestrator.rl.learner_group.LearnerGroup.weight_buckets`), for engines that join a pool whose
        pushes keep no buckets.
        ``envs``: the `env-i` actors hosting the episodes' environments (``env.num_workers`` > 0)."""
        self.cfg = cfg
        self.envs = envs
        self.max_model_len = max_model_len
        self.version = 0
        self.buckets: list = []  # the last object-store push (a new engine loads exactly that version)
        self.current_weights = current_weights
        self.membership = 0  # bumped whenever a worker is replaced, added or removed (a weight group is re-formed)
        super().__init__(cfg.rollout.num_workers, cfg.rollout.max_restarts)

    def _spawn(self, index: int, name: str):
        r = self.cfg.rollout
        actor = ray.remote(RolloutWorker).options(
            num_cpus=r.num_cpus, num_gpus=r.num_gpus * r.tensor_parallel_size, max_concurrency=1,
            resources=r.resources or None,
            **self._options(name, {**CPU_ENV, "OMP_NUM_THREADS": str(engine_threads(self.cfg))}),
        )
        return actor.remote(engine_spec(self.cfg, self.max_model_len, index))

    def _after_restart(self, worker) -> None:
        """A new or replacement engine gets the current weights through the object store before any prompt
        (with collective pushes the pool keeps no buckets: ``current_weights`` asks the learner for them)."""
        self.membership += 1  # a collective weight group must be rebuilt
        buckets = self.buckets or (self.current_weights() if self.current_weights and self.version else [])
        if buckets:
            ray.get(worker.load_weights.remote(buckets, self.version))

    def _after_removal(self) -> None:
        self.membership += 1  # a collective weight group without the removed engine is formed before the next push

    def rebuild(self, cfg: FleetConfig, max_model_len: int) -> list:
        """Every engine replaced in place by one built for a run of ``cfg`` (:meth:`RolloutWorker.rebuild`: same
        actors, new engines, ``model.path``'s weights read from disk): ObjectRefs that resolve once they are built."""
        self.cfg, self.max_model_len = cfg, max_model_len
        self.buckets, self.version = [], 0
        self.membership += 1  # new engines: a collective weight group is formed again
        threads = engine_threads(cfg)
        return [w.rebuild.remote(engine_spec(cfg, max_model_len, i), threads) for i, w in enumerate(self.workers)]

    def load_model(self, path: str) -> None:
        """Every engine reloads the weights of the model directory ``path`` from disk, in place (a run without a
        learner on engines a training run pushed into); a replacement engine then starts from ``path`` too."""
        ray.get([w.load_model_weights.remote(path) for w in self.workers])
        self.buckets, self.version = [], 0

    def generate(self, prompts: list[Prompt], group_size: int, temperature: float, seed: int | None,
                 prefixes: list[list[int]] | None = None, stop: list[str] | None = None,
                 max_new_tokens: int | None = None) -> list[Sample]:
        """``group_size`` samples per prompt, grouped by prompt: completions, or multi-turn episodes (``env.name`` or
        ``env.agent``; :meth:`RolloutWorker.run_episodes`). ``prefixes``, ``stop``: continue partial solutions, stop
        at extra strings (:meth:`RolloutWorker.generate`); ``max_new_tokens``: instead of ``rollout.max_new_tokens``."""
        r = self.cfg.rollout
        items = [(p.uid, p.text, p.metadata) for p in prompts]
        if prefixes is not None:
            parts = _chunks(list(zip(items, prefixes)), len(self.workers))
            budget = max_new_tokens or r.max_new_tokens
            outs = self.fan_out(lambda w, part: w.generate.remote(
                [x for x, _ in part], group_size, budget, temperature, r.top_p, seed, [pre for _, pre in part],
                stop), parts)
            return [s for out in outs for s in out]
        parts = _chunks(items, len(self.workers))
        if self.cfg.env.multi_turn:
            env = env_spec(self.cfg)
            actors = self.envs.workers if self.envs else None
            if self.cfg.env.agent == "external":
                self.publish_agent_endpoints(env)
            outs = self.fan_out(lambda w, part: w.run_episodes.remote(part, group_size, env, r.max_new_tokens,
                                                                      temperature, r.top_p, seed, actors), parts)
        else:
            outs = self.fan_out(lambda w, part: w.generate.remote(part, group_size, max_new_tokens or r.max_new_tokens,
                                                                  temperature, r.top_p, seed, None, stop), parts)
        return [s for out in outs for s in out]

    def publish_agent_endpoints(self, env: dict) -> None:
        """``<run.dir>/agent_endpoints.json``: every engine's endpoint address and token, for agents outside the
        fleet (``env.agent: external``); rewritten before each call (a replaced actor has a new address). Readable
        by its owner only (it holds the tokens); the run removes it when it ends (:meth:`Run.run`)."""
        import json
        import os
        from pathlib import Path

        budget = self.cfg.rollout.max_new_tokens
        addresses = ray.get([w.agent_address.remote(env, budget) for w in self.workers])
        path = Path(self.cfg.run.dir) / AGENT_ENDPOINTS
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)  # created anew: O_CREAT's mode applies to a new file only
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(json.dumps({"endpoints": addresses}, indent=1))
        tmp.replace(path)

    def option_logprobs(self, prompts: list[list[dict]], prefix: str,
                        option_ids: list[int]) -> list[list[float] | None]:
        """Each chat prompt's next-token logprobs of ``option_ids`` after ``prefix`` (None: too long for the
        engine), spread over the engines in order (:meth:`RolloutWorker.option_logprobs`)."""
        outs = self.fan_out(lambda w, part: w.option_logprobs.remote(part, prefix, option_ids),
                            _chunks(prompts, len(self.workers)))
        return [x for out in outs for x in out]

    def token_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Each sample's completion tokens scored by this pool's model (:meth:`RolloutWorker.token_logprobs`),
        spread over the engines in order."""
        parts = _chunks([(s.prompt_ids, s.completion_ids) for s in samples], len(self.workers))
        outs = self.fan_out(lambda w, part: w.token_logprobs.remote(part), parts)
        return [x for out in outs for x in out]

    def probe(self, prompts: list[Prompt], max_new_tokens: int, seed: int) -> list[Sample]:
        """Every engine samples each prompt once with the same seed (the weight push's check), at the temperature
        the learner scores at (:func:`learner_temperature`), so the two logprobs compare."""
        t, top_p = learner_temperature(self.cfg), self.cfg.rollout.top_p
        part = [(p.uid, p.text, p.metadata) for p in prompts]
        outs = self.fan_out(lambda w, part: w.generate.remote(part, 1, max_new_tokens, t, top_p, seed),
                            [part] * len(self.workers))
        return [s for out in outs for s in out]

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str,
                          timeout_s: float | None = None) -> list:
        """ObjectRefs of every engine joining the weight group (a rendezvous with learner rank 0)."""
        from workers.nccl_sync import engine_rank_offset

        tp = self.cfg.rollout.tensor_parallel_size
        return [w.join_weight_group.remote(host, port, engine_rank_offset(i, tp), world_size, backend, timeout_s)
                for i, w in enumerate(self.workers)]

    def receive_weights(self, plans: list, version: int) -> list:
        """ObjectRefs of every engine receiving one collective push."""
        self.version = version
        return [w.receive_weights.remote(plans, version) for w in self.workers]

    def load_weights(self, bucket_refs: list, version: int) -> list[dict]:
        self.version, self.buckets = version, bucket_refs
        return self.fan_out(lambda w, _: w.load_weights.remote(bucket_refs, version), [True] * len(self.workers))


class JudgePool(RolloutPool):
    """The `judge-i` engines of a feedback model (``cai.judge: model``): rollout engines of another model, never
    pushed to (Constitutional AI's preference labels, :mod:`orchestrator.recipes.cai`)."""

    role = "judge"


class TeacherPool(RolloutPool):
    """The `teacher-i` engines of ``distill.teacher`` (on-policy distillation): rollout engines of another model,
    never pushed to, that score the student's samples token by token."""

    role = "teacher"


class EnvPool(ActorPool):
    """The `env-i` actors (``env.num_workers`` > 0): they host the episodes' environments
    (:class:`workers.envs.remote.EnvWorker`); the rollout actors call them directly. Resized between steps."""

    role = "env"

    def __init__(self, cfg: FleetConfig):
        self.cfg = cfg
        super().__init__(cfg.env.num_workers, cfg.rollout.max_restarts)

    def _spawn(self, index: int, name: str):
        from workers.envs.remote import EnvWorker

        return ray.remote(EnvWorker).options(num_cpus=self.cfg.env.num_cpus, max_concurrency=1000,
                                             **self._options(name)).remote(env_spec(self.cfg))

    def heal(self) -> None:
        """Replace the `env-i` actors that died (between steps: their episodes of the step ended as ``env_error``
        and their groups were dropped; the rollout actors call env actors directly, so ``fan_out`` never sees the
        death). Counted in ``faults/env_restarts`` (budget ``rollout.max_restarts``)."""
        for i, worker in enumerate(self.workers):
            try:
                ray.get(worker.open_episodes.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                self.restart(i, e)


class RewardPool(ActorPool):
    """The `reward-i` actors. ``score`` spreads samples over workers and keeps order. With ``reward.model.path``
    set, the `reward-model-i` actors (:class:`RewardModelPool`) also score every sample: component
    ``reward_model``, added to the reward with weight ``reward.model.weight``. With a ``judge`` entry in
    ``reward.functions``, ``judge`` (a :class:`rewards.judge.Judge` and the engines it asks) adds component
    ``judge`` to the training samples (:meth:`score_judged`)."""

    role = "reward"

    def __init__(self, cfg: FleetConfig, judge: tuple | None = None):
        self.cfg = cfg
        super().__init__(cfg.reward.num_workers, cfg.reward.max_restarts)
        self.timeouts = 0  # reward-function calls stopped at reward.timeout_s, over the pool's life
        self.first_error: str | None = None  # the last score call's first failure, one line
        self.model_pool = RewardModelPool(cfg) if cfg.reward.model.path else None
        self.judge, self.judge_engines = judge or (None, None)
        self.sends_ids = sends_token_ids(cfg)

    def ready(self) -> list:
        own_engines = isinstance(self.judge_engines, JudgePool)
        return super().ready() + (self.model_pool.ready() if self.model_pool else []) + \
            (self.judge_engines.ready() if own_engines else [])

    def _spawn(self, index: int, name: str):
        rc = self.cfg.reward
        judge = self.cfg.judge_spec
        specs = [(f.name, f.weight, f.params) for f in rc.functions if f is not judge]
        return ray.remote(RewardWorker).options(num_cpus=rc.num_cpus, resources=rc.resources or None,
                                                **self._options(name)).remote(specs, rc.timeout_s, rc.strict,
                                                                              processes=rc.processes,
                                                                              memory_mb=rc.memory_mb)

    def score(self, samples: list[Sample]) -> tuple[list[ScoredSample], int]:
        """Every sample's reward and components from the functions and the reward model (not the judge), and how
        many reward-function calls failed."""
        parts = _chunks(samples, len(self.workers))
        outs = self.fan_out(
            lambda w, part: w.score.remote([(s.prompt_text, s.completion_text, s.metadata) for s in part],
                                           [(s.completion_ids, s.policy_version) for s in part]
                                           if self.sends_ids else None), parts)
        results, errors, self.first_error = [], 0, None
        for out, errs, timeouts, first in outs:
            results.extend(out)
            errors += errs
            self.timeouts += timeouts
            self.first_error = self.first_error or first
        scored = [ScoredSample(s, r.reward, r.components) for s, r in zip(samples, results)]
        if self.model_pool:
            weight = self.cfg.reward.model.weight
            for x, value in zip(scored, self.model_pool.score(samples)):
                if not math.isfinite(value):  # a learned model's NaN or inf: an error (reward/errors), scored 0
                    errors += 1
                    self.first_error = self.first_error or f"the reward model scored {value}, not a finite number"
                    value = 0.0
                x.components["reward_model"] = value
                x.reward += weight * value
        return scored, errors

    def score_judged(self, samples: list[Sample], prompts: list[Prompt]) -> tuple[list[ScoredSample], int, int]:
        """:meth:`score`, plus the judge's component when one is configured: ``(scored, reward-function errors,
        verdicts the judge could not read)``. ``prompts``: the task prompts the samples answer (the judge reads
        their conversations)."""
        scored, errors = self.score(samples)
        if self.judge is None:
            return scored, errors, 0
        from rewards.judge import as_messages

        texts = {p.uid: p.text for p in prompts}
        items = [(as_messages(texts[x.sample.prompt_uid]), x.sample.completion_text, x.sample.metadata)
                 for x in scored]
        values, judge_errors = self.judge.score(self.judge_engines, items)
        weight = self.cfg.judge_spec.weight
        for x, value in zip(scored, values):
            x.components["judge"] = value
            x.reward += weight * value
        return scored, errors, judge_errors


class RewardModelPool(ActorPool):
    """The `reward-model-i` actors, each hosting the reward model of ``reward.model.path``. ``score`` spreads
    samples over workers and keeps order; a dead actor is replaced and its share re-scored (budget
    ``reward.max_restarts``)."""

    role = "reward-model"

    def __init__(self, cfg: FleetConfig):
        self.cfg = cfg
        super().__init__(cfg.reward.model.num_workers, cfg.reward.max_restarts)

    def _spawn(self, index: int, name: str):
        rm = self.cfg.reward.model
        actor = ray.remote(RewardModelWorker).options(num_cpus=rm.num_cpus, **self._options(name))
        return actor.remote(rm.path, rm.batch_size, self.cfg.model.dtype, self.cfg.trainer.torch_threads)

    def score(self, samples: list[Sample]) -> list[float]:
        """The reward model's score of each sample, in order."""
        outs = self.fan_out(lambda w, part: w.score.remote([(s.prompt_text, s.completion_text) for s in part]),
                            _chunks(samples, len(self.workers)))
        return [v for out in outs for v in out]


class PRMPool(ActorPool):
    """The `prm-i` actors (or `orm-i` for the outcome model), each hosting a step-scoring model
    (:class:`rewards.prm.PRMWorker`). ``score`` spreads solutions over workers and keeps order; a dead actor is
    replaced and its share re-scored (budget ``reward.max_restarts``)."""

    def __init__(self, cfg: FleetConfig, path: str, role: str = "prm"):
        self.cfg, self.path, self.role = cfg, path, role
        super().__init__(cfg.prm.num_workers, cfg.reward.max_restarts)

    def _spawn(self, index: int, name: str):
        from rewards.prm import PRMWorker

        p = self.cfg.prm
        actor = ray.remote(PRMWorker).options(num_cpus=p.num_cpus, **self._options(name))
        return actor.remote(self.path, p.batch_size, self.cfg.trainer.torch_threads)

    def score(self, items: list[tuple[str, list[str]]]) -> list[list[float]]:
        """Each (prompt text, steps)'s step scores, in order."""
        outs = self.fan_out(lambda w, part: w.score.remote(part), _chunks(items, len(self.workers)))
        return [v for out in outs for v in out]


def wait_ready(*groups, timeout_s: float | None = None) -> None:
    """Wait until every actor of ``groups`` (pools, learner groups; None is skipped) has started. Groups are
    created without waiting, so the learner ranks, engines, reward and env actors start side by side and a run
    waits once, for the slowest; an actor whose constructor failed raises here, naming it and its log. Past
    ``timeout_s`` a StartupTimeout names the actors still starting and what the cluster has free."""
    refs = {ref: name for g in groups if g is not None for ref, name in zip(g.ready(), _names(g))}
    pending, deadline = list(refs), time.monotonic() + (timeout_s or float("inf"))
    while pending:  # in completion order: the first actor that fails is reported without waiting for the rest
        left = None if timeout_s is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            waiting = sorted(refs[r] for r in pending)
            raise StartupTimeout(f"{len(waiting)} actor(s) not started after {timeout_s:g} s (run.startup_timeout_s):"
                                 f" {', '.join(waiting[:8])}; the cluster has free {_free()}")
        try:
            ray.get(done[0])
        except ray.exceptions.RayError as e:
            if actor_label(e) is None:
                raise
            raise actor_failed(e, e) from e


def _names(group) -> list[str]:
    workers = getattr(group, "ranks", None) or group.workers
    return [actor_label(w) or f"{getattr(group, 'role', 'actor')}-{i}" for i, w in enumerate(workers)] + \
        [f"{getattr(group, 'role', 'actor')} (more)"] * 64  # a pool's ready() may add its sub-pools' actors


def _free() -> str:
    free = ray.available_resources()
    return ", ".join(f"{k} {v:g}" for k, v in sorted(free.items()) if not k.startswith(("node:", "memory",
                                                                                         "object_store")))


class StartupTimeout(RuntimeError):
    """The actors were not placed and started within ``run.startup_timeout_s``."""


def sends_token_ids(cfg: FleetConfig) -> bool:
    """Whether a reward function of ``cfg`` has TRL's signature (:func:`rewards.functions.is_batched`), which reads
    the completions' token ids and policy versions: only then do they travel to the reward actors. (A user
    function is imported here as the run's preflight already did; built-ins never take them.)"""
    from rewards.functions import is_batched, load_reward_function

    return any(is_batched(load_reward_function(f.name)) for f in cfg.reward.functions
               if ":" in f.name and f is not cfg.judge_spec)
