"""One object owns a run's actors: :class:`Fleet`. Every command declares which roles it uses (:class:`Roles`);
the fleet creates every group without waiting (learner ranks, vLLM engines, reward, env, PRM/ORM and judge actors
start side by side), waits once for the slowest, makes the weight sync when a learner and engines are both there,
and stops all of them once. A loop that never generates (SFT without evals, DPO on a pairs file, a reward model,
a PRM) declares no engine, so it starts no vLLM engine, no reward actor and no weight-sync probe.

A fleet can serve several runs in turn (:meth:`Fleet.serve`: pipeline stages, tests): a group whose actors fit the
next run keeps them. The learner ranks build the run's model, loss and optimizer in place (same ranks and
resources); engines of the same model shape and engine settings get the run's starting weights from the learner,
and CPU rollout actors of the same placement whose engines do not fit (other threads, context length, KV cache,
prompt settings, model) build new engines in their own processes (:func:`engine_key`; 2-4 s against ~20 s for a
new actor's start and imports); reward, env, PRM/ORM and judge actors with the same settings are kept as they are.
What does not fit is stopped and started again, and every kept actor writes its output under the new run's
``logs/``. A group the run does not use is parked (idle, out of the run's groups, logs and banner) for a later run
it fits, such as the RL stage after an SFT stage, unless it holds GPUs or custom resources (a parked GPU engine
keeps its memory) or a later run needs room that only stopping it frees. What is kept, rebuilt, parked, stopped
and started is decided by one pure function, :func:`plan_serve`; :meth:`Fleet.serve` carries its plan out.

A command other than the training driver takes its fleet from :meth:`Fleet.for_command`, which stops the fleet
on exit when the command started it and leaves a fleet it was given (a pipeline's) running.

This is the only module that creates actor groups (``git grep "Pool(\\|LearnerGroup("``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from orchestrator.config import FleetConfig
from orchestrator.rl.launch import resource_demand

log = logging.getLogger("fleetrl")


@dataclass(frozen=True)
class Roles:
    """What a command uses: each flag one actor group (see :class:`Fleet`)."""

    learner: bool = False  # the DeepSpeed policy ranks (`learner-i`)
    critic: bool = False  # PPO's value ranks (`critic-i`)
    rollout: bool = False  # the vLLM engines (`rollout-i`)
    reward: bool = False  # the reward-function actors (`reward-i`, and `reward-model-i` with reward.model.path)
    env: bool = False  # the environment actors (`env-i`)
    prm: bool = False  # the process reward model of prm.path (`prm-i`)
    orm: bool = False  # the outcome reward model of prm.orm_path (`orm-i`)
    feedback: bool = False  # the feedback model's engines of cai.feedback_model (`judge-i`)
    teacher: bool = False  # the teacher's engines of distill.teacher (`teacher-i`, on-policy distillation)
    controller: bool = False  # the run's controller (`fleetrl scale`, `stop`, dashboard metrics)

    def names(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]


def training_roles(cfg: FleetConfig, generates: bool, engine_evals: bool = True) -> Roles:
    """The roles of a training loop: ``generates`` (its steps sample from the policy: RL, RFT, online DPO), or
    only ``engine_evals`` (held-out evals through the engines, when ``trainer.eval_every`` asks for them)."""
    engines = generates or (engine_evals and cfg.trainer.eval_every > 0)
    return Roles(learner=True, critic=cfg.algorithm.uses_critic, rollout=engines, reward=generates,
                 env=engines and bool(cfg.env.name and cfg.env.num_workers),
                 prm=generates and bool(cfg.prm.path) and cfg.uses_process_rewards,
                 feedback=generates and bool(cfg.judge_spec) and cfg.cai.judge == "model",
                 teacher=generates and cfg.algorithm.uses_teacher, controller=True)


class Fleet:
    """The actor groups of one command (None where a role is not used): ``learner``, ``critic``
    (:class:`~orchestrator.rl.learner_group.LearnerGroup`), ``rollouts``, ``rewards``, ``envs``, ``prm``, ``orm``,
    ``feedback``, ``teacher`` (pools), ``controller`` and, with a learner and engines, ``weight_sync``."""

    def __init__(self, cfg: FleetConfig, roles: Roles, judge=None):
        """Create every group of ``roles`` without waiting (see :meth:`start`). ``judge``: the ``judge`` reward
        (:class:`rewards.judge.Judge`), asked through the feedback engines or the policy's."""
        from orchestrator.rl.launch import max_model_len
        from orchestrator.rl.learner_group import LearnerGroup
        from orchestrator.rl.pools import EnvPool, PRMPool, RewardPool, RolloutPool

        self.cfg, self.roles, self.startup_s = cfg, roles, None
        self.kept: list[str] = []  # the groups the last run served kept from the runs before it (serve)
        self.built = {r: cfg for r in roles.names() if r != "controller"}  # per group, the config it last fitted
        self.parked: dict[str, object] = {}  # the groups of roles the last run did not use, by role (serve)
        self.t0 = time.perf_counter()
        self.learner = LearnerGroup(cfg) if roles.learner else None
        self.critic = LearnerGroup(cfg, role="critic") if roles.critic else None
        self.envs = EnvPool(cfg) if roles.env else None
        self.rollouts = RolloutPool(cfg, max_model_len=max_model_len(cfg), envs=self.envs,
                                    current_weights=self.learner.weight_buckets if self.learner else None) \
            if roles.rollout else None
        self.feedback = _feedback_engines(cfg) if roles.feedback else None
        self.teacher = _teacher_engines(cfg) if roles.teacher else None
        self.rewards = RewardPool(cfg, judge=(judge, self.feedback or self.rollouts) if judge else None) \
            if roles.reward else None
        self.prm = PRMPool(cfg, cfg.prm.path) if roles.prm else None
        self.orm = PRMPool(cfg, cfg.prm.orm_path, role="orm") if roles.orm else None
        self.controller = self._controller() if roles.controller else None
        self.weight_sync = None
        self.runs = 0  # the runs this fleet served (serve)
        self.engine_weights = _engine_weights(cfg, roles)

    @classmethod
    def start(cls, cfg: FleetConfig, roles: Roles, judge=None, probe: tuple | None = None) -> Fleet:
        """A fleet whose actors are all ready. ``probe``: ``(prompts, pad_id)`` for the weight push's check
        (:mod:`orchestrator.rl.weight_sync`), needed when the roles hold a learner and engines. A start that fails
        stops what it started."""
        check_resources(cfg, roles)
        fleet = cls(cfg, roles, judge)
        try:
            fleet.wait()
            if fleet.learner and fleet.rollouts:
                from orchestrator.rl.weight_sync import make_weight_sync

                fleet.weight_sync = make_weight_sync(cfg, fleet.learner, fleet.rollouts, *probe)
        except BaseException:
            fleet.stop()
            raise
        fleet.startup_s = time.perf_counter() - fleet.t0
        log.info("fleet up in %.1fs: %s", fleet.startup_s, fleet.describe())
        return fleet

    @classmethod
    def for_run(cls, fleet: Fleet | None, cfg: FleetConfig, roles: Roles, judge=None,
                probe: tuple | None = None) -> Fleet:
        """``fleet`` serving a run of ``cfg`` (:meth:`serve`), or without one a new fleet (:meth:`start`)."""
        return fleet.serve(cfg, roles, judge, probe) if fleet is not None else cls.start(cfg, roles, judge, probe)

    @classmethod
    @contextlib.contextmanager
    def for_command(cls, fleet: Fleet | None, cfg: FleetConfig, roles: Roles, judge=None,
                    probe: tuple | None = None) -> Iterator[Fleet]:
        """The fleet of a command that is not the training driver (eval, search, PRM labelling, CAI data), which
        stops exactly what it started: ``fleet`` serving the command (:meth:`serve`), left running on exit for its
        owner (a pipeline, the test suite's fleet server), or, without one, a fleet of the command's own
        (:meth:`start`), stopped on exit, error or not. Joins or starts Ray first (:func:`init_ray`)."""
        from orchestrator.rl.launch import init_ray

        init_ray(cfg)
        if fleet is not None:
            yield fleet.serve(cfg, roles, judge, probe)
            return
        with cls.start(cfg, roles, judge, probe) as own:
            yield own

    def serve(self, cfg: FleetConfig, roles: Roles, judge=None, probe: tuple | None = None) -> Fleet:
        """This fleet, ready for a run of ``cfg`` with ``roles`` (see the module): kept where the actors fit,
        replaced where they do not (:func:`plan_serve`); the engines serve the run's starting model. The first run
        of a fleet started for exactly this config uses it as it is."""
        import ray

        t0 = time.perf_counter()
        self.runs += 1
        if self.runs == 1 and cfg == self.cfg and roles == self.roles:
            return self
        self.cfg, self.roles = cfg, roles
        plan = self._plan(cfg, roles, judge is not None)
        self._apply(plan, cfg)
        self._log_to(cfg, plan.keep)
        loading = [ref for role in ("learner", "critic") if role in plan.keep for ref in getattr(self, role).load(cfg)]
        loading += self._new_engines(cfg, plan.rebuild)
        self._make_room(cfg, plan.start)
        fresh = Fleet(cfg, Roles(**dict.fromkeys(plan.start, True)), judge)
        for role in plan.start:
            setattr(self, _ATTR[role], getattr(fresh, _ATTR[role]))
        self.built |= dict.fromkeys([*plan.keep, *plan.start], cfg)
        if self.rollouts is not None:  # the groups' links, across kept and new groups
            self.rollouts.envs = self.envs
            self.rollouts.current_weights = self.learner.weight_buckets if self.learner else None
        if self.rewards is not None and judge is not None:
            self.rewards.judge_engines = self.feedback or self.rollouts
        self.controller = self._controller() if roles.controller else None
        if plan.reload:
            self.rollouts.load_model(cfg.model.path)  # no learner to push the run's model: from disk, in place
        if roles.rollout:
            self.engine_weights = _engine_weights(cfg, roles)
        ray.get(loading)
        self.wait()
        self.weight_sync = None
        if self.learner and self.rollouts:
            from orchestrator.rl.weight_sync import make_weight_sync

            self.weight_sync = make_weight_sync(cfg, self.learner, self.rollouts, *probe)
            if "rollout" in plan.keep:  # the engines hold the last run's weights: the run starts from its own
                self.weight_sync.push(0)
        self.startup_s, self.kept = time.perf_counter() - t0, sorted(plan.keep)
        log.info("fleet served a new run in %.1fs: kept %s%s%s; %s", self.startup_s, self.kept or "nothing",
                 f" (new engines in the {' and '.join(sorted(plan.rebuild))} actors)" if plan.rebuild else "",
                 f", parked {sorted(self.parked)}" if self.parked else "", self.describe())
        return self

    def state(self) -> FleetState:
        """What :func:`plan_serve` reads of this fleet (its actors are not asked whether they answer)."""
        in_place = frozenset(role for role, attr in _ATTR.items() if getattr(self, attr) is not None)
        return FleetState(built=dict(self.built), in_place=in_place, parked=frozenset(self.parked),
                          judged=self.rewards is not None and self.rewards.judge is not None,
                          engine_weights=self.engine_weights)

    def _plan(self, cfg: FleetConfig, roles: Roles, judge: bool) -> ServePlan:
        """:func:`plan_serve` for this fleet, the groups it would keep asked first whether their actors answer: an
        actor a run lost (killed, out of memory) takes its group with it."""
        state = self.state()
        plan = plan_serve(state, cfg, roles, judge)
        dead = self._dead(plan.keep)
        return plan_serve(replace(state, dead=frozenset(dead)), cfg, roles, judge) if dead else plan

    def _apply(self, plan: ServePlan, cfg: FleetConfig) -> None:
        """Carry out ``plan``'s unparking, stopping and parking; the kept groups replace their actors from
        ``cfg`` from now on, with the restart budget of a new run."""
        for role in plan.unpark:
            setattr(self, _ATTR[role], self.parked.pop(role))
        for role in plan.stop:
            self._stop(role)
        for role in plan.park:
            self.parked[role] = getattr(self, _ATTR[role])
            setattr(self, _ATTR[role], None)
        for role in plan.keep:
            group = getattr(self, _ATTR[role])
            group.cfg = group_config(cfg, role)  # what a replacement actor is built from
            if hasattr(group, "restarts"):
                group.restarts, group.recovery_s = 0, 0.0  # the budget is per run

    def _make_room(self, cfg: FleetConfig, new: tuple[str, ...], wait_s: float = 5.0) -> None:
        """Stop every parked group when the cluster lacks what the ``new`` groups ask for (CPUs, GPUs, custom
        resources, :func:`room_for`); the actors stopped just before free theirs within ``wait_s``."""
        import ray

        if not (self.parked and new):
            return
        deadline = time.monotonic() + wait_s
        while not room_for(cfg, new, ray.available_resources()):
            if time.monotonic() > deadline:
                log.info("fleet: no room for %s beside the parked %s; stopping them", list(new), sorted(self.parked))
                for role in list(self.parked):
                    self._stop(role)
                return
            time.sleep(0.2)

    def _new_engines(self, cfg: FleetConfig, roles: frozenset[str]) -> list:
        """The engine ``roles`` build new engines for a run of ``cfg`` in their actors: refs of the builds."""
        from orchestrator.rl.launch import max_model_len

        refs = []
        for role in roles:
            built_from = group_config(cfg, role)
            refs += getattr(self, _ATTR[role]).rebuild(built_from, max_model_len(built_from))
        return refs

    def _dead(self, roles: frozenset[str], timeout_s: float = 60.0) -> set[str]:
        """Those of ``roles`` with an actor that does not answer (dead, or busy past ``timeout_s``)."""
        import ray

        pings = {role: [w.ready.remote() for w in self._handles(role)] for role in roles}
        dead = set()
        for role, refs in pings.items():
            try:
                ray.get(refs, timeout=timeout_s)
            except (ray.exceptions.RayError, TimeoutError):
                log.warning("fleet: a %s actor does not answer; the group is started again", role)
                dead.add(role)
        return dead

    def _group(self, role: str):
        """``role``'s group, in place or parked (None without one)."""
        return self.parked[role] if role in self.parked else getattr(self, _ATTR[role])

    def _handles(self, role: str) -> list:
        """Every actor of ``role``'s group, in place or parked (the reward group's model actors too)."""
        group = self._group(role)
        if group is None:
            return []
        if role == "controller":
            return [group]
        handles = group.handles()
        if role == "reward" and group.model_pool is not None:
            handles += group.model_pool.handles()
        return handles

    def _log_to(self, cfg: FleetConfig, kept: set[str]) -> None:
        """Every kept actor writes its output under ``<run.dir>/logs`` from now on."""
        import ray

        from orchestrator.telemetry.console import log_dir, remember_actor

        handles = [w for role, ws in self.workers().items() if role.split("-")[0] in kept for w in ws]
        paths = ray.get([w.log_to.remote(str(log_dir(cfg.run.dir))) for w in handles])
        for w, path in zip(handles, paths):
            if path:
                remember_actor(w, Path(path).stem, cfg.run.dir)

    def _stop(self, role: str) -> None:
        """Kill ``role``'s group, in place or parked (and free a learner group's placement group)."""
        import ray

        group = self._group(role)
        if group is None:
            return
        for w in self._handles(role):
            with contextlib.suppress(Exception):
                ray.kill(w, no_restart=True)
        if role in ("learner", "critic"):
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group.pg)
        self.parked.pop(role, None)
        setattr(self, _ATTR[role], None)
        self.built.pop(role, None)

    def groups(self) -> dict[str, object]:
        """The groups started, by role."""
        named = {"learner": self.learner, "critic": self.critic, "env": self.envs, "rollout": self.rollouts,
                 "feedback": self.feedback, "teacher": self.teacher, "reward": self.rewards, "prm": self.prm,
                 "orm": self.orm}
        return {k: g for k, g in named.items() if g is not None}

    def wait(self) -> None:
        """Block until every actor has started (:func:`orchestrator.rl.pools.wait_ready`)."""
        from orchestrator.rl.pools import wait_ready

        wait_ready(*self.groups().values(), timeout_s=self.cfg.run.startup_timeout_s)

    def workers(self) -> dict[str, list]:
        """Every actor handle by role (a learner group's ranks, a pool's workers)."""
        out = {}
        for role, g in self.groups().items():
            out[role] = g.handles()
            if role == "reward" and g.model_pool is not None:
                out["reward-model"] = g.model_pool.handles()
        return out

    def describe(self) -> str:
        """The roles and their counts, for the banner (``2 rollout (vLLM), 1 reward, learner 2 ranks ...``)."""
        c, parts = self.cfg, []
        if self.rollouts:
            parts.append(f"{len(self.rollouts.workers)} rollout (vLLM)")
        if self.rewards:
            parts.append(f"{len(self.rewards.workers)} reward")
        for group in (self.learner, self.critic):
            if group:
                ranks = f"{group.world} rank{'s' if group.world != 1 else ''}"
                parts.append(f"learner {ranks} (DeepSpeed ZeRO-{c.learner.zero_stage})" if group is self.learner
                             else f"critic {ranks}")
        if self.rewards and self.rewards.model_pool:
            parts.append(f"{len(self.rewards.model_pool.workers)} reward-model")
        for role in ("env", "prm", "orm", "feedback", "teacher"):
            g = self.groups().get(role)
            if g:
                parts.append(f"{len(g.workers)} {'judge' if role == 'feedback' else role}")
        return ", ".join(parts) or "none"

    def peak_rss(self) -> dict[str, float]:
        """Peak resident memory of every actor, MB (ru_maxrss), as ``<role>-<i>``."""
        import ray

        refs = {f"{role}-{i}": w.peak_rss_mb.remote() for role, ws in self.workers().items()
                for i, w in enumerate(ws)}
        return dict(zip(refs, ray.get(list(refs.values()))))

    def stop(self) -> None:
        """Kill every actor once, parked ones too (and free the learner groups' placement groups); safe to call
        twice."""
        for role in _ATTR:
            self._stop(role)
        self.weight_sync = None

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _controller(self):
        from pathlib import Path

        from orchestrator.telemetry.controller import start_controller

        c = self.cfg
        return start_controller(Path(c.run.dir).name, c.rollout.num_workers if self.rollouts else 0,
                                c.reward.num_workers if self.rewards else 0, c.env.num_workers if self.envs else 0)


def reloadable(cfg: FleetConfig) -> bool:
    """Whether kept engines can load ``model.path`` from disk in place (:meth:`RolloutPool.load_model`): its
    weights are safetensors files and the engines serve no LoRA adapter."""
    return not cfg.learner.lora.enabled and any(Path(cfg.model.path).glob("*.safetensors"))


def _engine_weights(cfg: FleetConfig, roles: Roles) -> str | None:
    """The model directory whose weights a fleet's engines hold unchanged after a run of ``cfg`` with ``roles``:
    ``model.path`` when no learner pushes into them, else none (the run's pushes change them)."""
    return cfg.model.path if roles.rollout and not roles.learner else None


def check_resources(cfg: FleetConfig, roles: Roles) -> None:
    """GPUs and custom resources the roles ask for that the connected cluster does not have at all: a ConfigError
    before any actor is created (Ray would wait for them forever; CPUs are not checked: a private local instance is
    sized to the run, and on a cluster more CPUs mean waiting, not never)."""
    import ray

    from orchestrator.config import ConfigError

    if not (cfg.run.ray_address or os.environ.get("RAY_ADDRESS")):
        check_this_machine(cfg, roles)
    have = ray.cluster_resources()
    for name, by_role in resource_demand(cfg, roles.names()).items():
        if name == "CPU":
            continue
        need = sum(by_role.values())
        if need > have.get(name, 0.0) + 1e-9:
            who = ", ".join(f"{role} {v:g}" for role, v in by_role.items())
            raise ConfigError(f"the run asks for {need:g} {name} ({who}); the cluster has {have.get(name, 0.0):g} "
                              f"(set learner.num_gpus / rollout.num_gpus / the roles' resources to what it has)")


def check_this_machine(cfg: FleetConfig, roles: Roles) -> None:
    """A private local Ray instance runs every actor here: more learner ranks than cores, or CPU engines' KV caches
    larger than the free memory, are refused (a ConfigError naming the key) rather than found out minutes later."""
    import psutil

    from orchestrator.config import ConfigError

    cores = os.cpu_count() or 1
    if roles.learner and cfg.learner.num_ranks > cores:
        raise ConfigError(f"learner.num_ranks={cfg.learner.num_ranks}: this machine has {cores} cores, and each rank "
                          "is a process of its own; use at most that many (or a cluster, run.ray_address)")
    r = cfg.rollout
    if roles.rollout and not r.num_gpus:
        engines = r.num_workers + (cfg.distill.teacher_workers if roles.teacher else 0)
        need, free = r.kv_cache_gib * engines, psutil.virtual_memory().available / 2**30
        if need > free:
            teachers = f" + distill.teacher_workers={cfg.distill.teacher_workers}" if roles.teacher else ""
            raise ConfigError(f"rollout.kv_cache_gib={r.kv_cache_gib} x (rollout.num_workers={r.num_workers}"
                              f"{teachers}) = {need:g} GiB of KV cache; this machine has {free:.1f} GiB free")


_ATTR = {"learner": "learner", "critic": "critic", "env": "envs", "rollout": "rollouts", "feedback": "feedback",
         "teacher": "teacher", "reward": "rewards", "prm": "prm", "orm": "orm", "controller": "controller"}
"""Role -> the Fleet attribute holding its group."""


@dataclass(frozen=True)
class FleetState:
    """What :func:`plan_serve` reads of a fleet between runs: no actor handle, nothing asked of Ray."""

    built: Mapping[str, FleetConfig]  # per group, in place or parked, the config it was last fitted to
    in_place: frozenset[str]  # the roles whose groups are in place (the controller's included)
    parked: frozenset[str] = frozenset()  # the roles whose groups are parked
    dead: frozenset[str] = frozenset()  # the roles whose groups have an actor that does not answer
    judged: bool = False  # the reward group in place holds a judge's engines (a ``judge`` reward function)
    engine_weights: str | None = None  # the model directory the engines hold unchanged (:func:`_engine_weights`)


@dataclass(frozen=True)
class ServePlan:
    """What :meth:`Fleet.serve` does with each group for the next run (:func:`plan_serve`), in this order: unpark,
    stop, park, then keep (rebuilding, reloading) and start."""

    unpark: frozenset[str]  # parked groups of roles the run uses, back in place (then kept or stopped)
    stop: frozenset[str]  # groups that do not fit a role the run uses, and unused ones that cannot be parked
    park: frozenset[str]  # groups in place of roles the run does not use, set aside for a later run
    keep: frozenset[str]  # the groups that serve the run (the learner's ranks load it, engines get its weights)
    rebuild: frozenset[str]  # kept engine groups that build new engines in their actors (:func:`engine_key`)
    reload: bool  # the kept rollout engines load ``model.path`` from disk (no learner to push it)
    start: tuple[str, ...]  # the roles whose groups are started new, in :class:`Roles` order (the controller not)


def plan_serve(state: FleetState, cfg: FleetConfig, roles: Roles, judge: bool = False) -> ServePlan:
    """What a fleet in ``state`` does for a run of ``cfg`` with ``roles`` (``judge``: the run's reward has a judge):
    a group of a used role is kept when it fits (:func:`fit_keys`, parked ones included) and answers; kept engines
    whose :func:`engine_key` differs build new engines; kept rollout engines without a learner to push the run's
    model need it already (:func:`_engine_weights`) or loadable in place (:func:`reloadable`); a reward group is
    never kept across a judge (it holds engines of the run that made it). An unused group is parked unless it holds
    GPUs or custom resources (a parked GPU engine keeps its memory), is the controller (started again for every
    run) or holds a judge's engines; parked groups of unused roles stay parked. Everything else is stopped."""
    used = set(roles.names()) - {"controller"}
    unpark = used & state.parked
    have = used & (state.in_place | unpark)
    after, before = fit_keys(cfg), _fit_keys_of({r: state.built[r] for r in have})
    keep = {r for r in have if before[r] == after[r]} - state.dead
    rebuild = {r for r in keep & set(PUSHED) if engine_key(state.built[r], r) != engine_key(cfg, r)}
    if "rollout" in keep and not ("rollout" in rebuild or roles.learner or state.engine_weights == cfg.model.path
                                  or reloadable(cfg)):
        keep.discard("rollout")  # no learner to push the run's model, and it cannot be loaded from disk
    if judge or state.judged:
        keep.discard("reward")
    idle = state.in_place - used
    park = {r for r in idle if _parkable(state, r)}
    reload = "rollout" in (keep - rebuild) and not roles.learner and state.engine_weights != cfg.model.path
    return ServePlan(unpark=frozenset(unpark), stop=frozenset((have - keep) | (idle - park)), park=frozenset(park),
                     keep=frozenset(keep), rebuild=frozenset(rebuild), reload=reload,
                     start=tuple(r for r in roles.names() if r not in keep and r != "controller"))


def _parkable(state: FleetState, role: str) -> bool:
    """Whether ``role``'s group in place can be set aside for a later run (see :func:`plan_serve`)."""
    if role == "controller" or (role == "reward" and state.judged):
        return False
    return not set(resource_demand(state.built[role], [role])) - {"CPU"}


def room_for(cfg: FleetConfig, roles: Iterable[str], available: Mapping[str, float]) -> bool:
    """Whether ``available`` resources (``ray.available_resources()``) hold what the groups of ``roles`` ask for."""
    need = {k: sum(v.values()) for k, v in resource_demand(cfg, roles).items()}
    return all(n <= available.get(k, 0.0) + 1e-9 for k, n in need.items())


def fit_keys(cfg: FleetConfig) -> dict[str, object]:
    """Per role, what its actors were built from, apart from the weights a run loads or pushes: another run whose
    key is the same can use them (:meth:`Fleet.serve`). CPU engine actors (rollout, teacher) fit any run with the
    same placement (:func:`engine_pool_key`): other engine settings or another model get new engines in the same
    processes (:func:`engine_key`); GPU engines are never rebuilt in place (freeing a GPU engine's memory
    in-process is not reliable), so their engine settings are part of their key."""
    from orchestrator.rl.specs import placement_key

    c = cfg.model_dump(mode="json")
    r = c["rollout"]
    pool = engine_pool_key(cfg)
    ranks = placement_key(cfg)

    def engines(role: str):
        built_from = group_config(cfg, role)
        placed = engine_pool_key(built_from)
        return (placed, engine_key(cfg, role)) if cfg.rollout.num_gpus else placed | {"threads": None}

    return {
        "learner": ranks, "critic": ranks, "rollout": engines("rollout"),
        "teacher": engines("teacher") if cfg.algorithm.uses_teacher else None,
        "reward": (c["reward"], c["cai"]), "env": (c["env"], r["max_restarts"], c["data"]["system_prompt"]),
        "prm": (c["prm"], c["reward"]["max_restarts"], c["trainer"]["torch_threads"]),
        "orm": (c["prm"], c["reward"]["max_restarts"], c["trainer"]["torch_threads"]),
        "feedback": (c["cai"], pool, c["data"]["max_prompt_tokens"], r["max_new_tokens"]),
    }


def _fit_keys_of(built: dict[str, FleetConfig]) -> dict[str, object]:
    """Per role of ``built``, the fit key (:func:`fit_keys`) of the config its group was last fitted to."""
    by_cfg = {id(c): fit_keys(c) for c in built.values()}
    return {role: by_cfg[id(c)][role] for role, c in built.items()}


PUSHED = {"rollout": True, "teacher": False}
"""The engine roles that can get new engines in their actors (:meth:`Fleet.serve`), and whether the learner pushes
their weights (the policy's engines) or they serve their model directory as it is (the teacher's)."""


def engine_key(cfg: FleetConfig, role: str = "rollout") -> tuple:
    """What the engines inside ``role``'s actors (see :data:`PUSHED`) were built from for a run of ``cfg``: threads,
    engine settings, and the model's shape (pushed weights) or its directory (a teacher). Kept CPU engine actors
    whose key differs build new engines in place (:meth:`~orchestrator.rl.pools.RolloutPool.rebuild`)."""
    from orchestrator.rl.launch import max_model_len
    from orchestrator.rl.specs import engine_spec, engine_threads

    built_from = group_config(cfg, role)
    spec = engine_spec(built_from, max_model_len(built_from))
    if PUSHED[role]:
        return engine_threads(built_from), replace(spec, model_path=""), model_shape(built_from.model.path)
    return engine_threads(built_from), spec


def engine_pool_key(cfg: FleetConfig) -> dict:
    """What a pool of ``cfg``'s rollout engines is placed with: count, resources, threads."""
    from orchestrator.rl.specs import engine_threads

    r = cfg.rollout
    return {"num_workers": r.num_workers, "num_cpus": r.num_cpus, "num_gpus": r.num_gpus, "resources": r.resources,
            "max_restarts": r.max_restarts, "threads": engine_threads(cfg)}


def model_shape(path: str) -> tuple:
    """A model directory's architecture (config.json without its name, dtype and version) and tokenizer (vocabulary,
    special tokens, chat template): two directories of the same shape take each other's weights in the same
    engines. (Files are compared as what they load to: `save_pretrained` rewrites a tokenizer's bytes.)"""
    import hashlib
    import json

    from orchestrator.rl.launch import load_tokenizer

    try:
        arch = json.loads((Path(path) / "config.json").read_text())
        tok = load_tokenizer(path)
    except (OSError, ValueError):
        return (path,)
    for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        arch.pop(k, None)
    vocab = json.dumps([sorted(tok.get_vocab().items()), tok.all_special_tokens, tok.chat_template])
    return json.dumps(arch, sort_keys=True), hashlib.sha256(vocab.encode()).hexdigest()


def teacher_config(cfg: FleetConfig) -> FleetConfig:
    """The config the `teacher-i` engines are built from: the rollout engines' settings serving ``distill.teacher``
    (no LoRA adapter: the teacher is a whole model; its own chat template, not ``data.chat_template``),
    ``distill.teacher_workers`` of them, with one more token of context than the student's (prompt logprobs of a
    sequence are read with one token generated after it)."""
    tcfg = cfg.model_copy(deep=True)
    tcfg.model.path = str(cfg.distill.teacher)
    tcfg.data.chat_template = None
    tcfg.learner.lora.rank = 0
    tcfg.rollout.num_workers = cfg.distill.teacher_workers
    tcfg.data.max_prompt_tokens += 1
    tcfg.env.max_total_tokens += 1
    return tcfg


def _teacher_engines(cfg: FleetConfig):
    """The `teacher-i` engines (on-policy distillation): see :func:`teacher_config`."""
    from orchestrator.rl.launch import max_model_len
    from orchestrator.rl.pools import TeacherPool

    tcfg = teacher_config(cfg)
    return TeacherPool(tcfg, max_model_len=max_model_len(tcfg))


def feedback_config(cfg: FleetConfig) -> FleetConfig:
    """The config the `judge-i` engines of ``cai.feedback_model`` are built from (one engine, no system prompt, its
    own chat template, room for the question around a conversation and a full-length response)."""
    judge_cfg = cfg.model_copy(deep=True)
    judge_cfg.model.path = cfg.cai.feedback_model
    judge_cfg.data.system_prompt = judge_cfg.data.chat_template = None
    judge_cfg.data.max_prompt_tokens = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens + 256
    judge_cfg.rollout.num_workers = 1
    return judge_cfg


def _feedback_engines(cfg: FleetConfig):
    """The `judge-i` engines (``cai.judge: model``): see :func:`feedback_config`."""
    from orchestrator.rl.launch import max_model_len
    from orchestrator.rl.pools import JudgePool

    judge_cfg = feedback_config(cfg)
    return JudgePool(judge_cfg, max_model_len=max_model_len(judge_cfg))


GROUP_CONFIG = {"teacher": teacher_config, "feedback": feedback_config}
"""The roles whose engines serve another model than the run's: the config their actors (and replacements) are
built from."""


def group_config(cfg: FleetConfig, role: str) -> FleetConfig:
    """The config ``role``'s actors (and their replacements) are built from for a run of ``cfg``: the run's own,
    or for the roles in :data:`GROUP_CONFIG` the one of the model they serve."""
    return GROUP_CONFIG[role](cfg) if role in GROUP_CONFIG else cfg
