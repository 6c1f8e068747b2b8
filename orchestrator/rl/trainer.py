"""The single controller: one driver owns the loop and calls typed methods on the actor groups.

    generate -> score -> (learner logprobs) -> advantages -> update -> push weights

Each phase is timed; one JSON object per step goes to metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from learner.algorithms import advantage_inputs, assemble_advantages
from learner.batch import TrainBatch, build_batch
from orchestrator.config import FleetConfig, dump_config
from orchestrator.evaluation.samples import eval_records, restate_frac, shown, write_eval_samples
from orchestrator.ops.console import Console, banner, sample_line, slow_bf16_warning
from orchestrator.ops.metrics import MetricsLogger, PhaseTimer
from orchestrator.ops.run_status import RunStatus
from orchestrator.rl import checkpoint as ckpt
from orchestrator.rl.episode_metrics import drop_errored_groups, episode_metrics, eval_episode_metrics
from orchestrator.rl.fleet import Fleet, Roles, check_resources, check_this_machine, training_roles
from orchestrator.rl.launch import init_ray, load_tokenizer, make_task
from orchestrator.rl.pools import LearnerDied, Update, gather_update
from orchestrator.rl.steps import process_separator, step_ends
from rewards.functions import verdicts, verify_timeouts
from workers.prompts import pad_token_id
from workers.records import Collected, ScoredSample

log = logging.getLogger("fleetrl")


class Trainer:
    def __init__(self, cfg: FleetConfig, resume: str | None = None, console: Console | None = None):
        self.t_config = time.perf_counter()  # config loaded: time/startup_s and time/first_step_s count from here
        self.startup_s = None  # -> all actors ready
        self.cfg = cfg
        self.console = console or Console(verbose=cfg.run.verbose)
        self.dashboard: str | None = None  # the Ray dashboard's URL, when there is one
        self.run_dir = Path(cfg.run.dir)
        self.task = make_task(cfg)
        self.eval_prompts = self.task.eval_set(cfg.data.eval_size)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.pad_id = pad_token_id(self.tokenizer)
        self.version = 0
        self.start_step = 0
        self.prefetch = None  # one_step_off: the next step's batch, being generated and scored
        self.engines_stale = False  # a supervised step updated the learner: push before the engines generate
        self.stop_requested = False  # `fleetrl stop`: end at the next step boundary
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self.resume_from = ckpt.resolve(resume, self.run_dir) if resume else None
        self.judge = None  # the `judge` reward (rewards/judge.py), checked before any actor starts
        self.fleet: Fleet | None = None  # the actors (start)
        self.status: RunStatus | None = None
        if cfg.judge_spec:
            from orchestrator.recipes.cai import reward_judge

            self.judge = reward_judge(cfg)

    @classmethod
    def prepare(cls, cfg: FleetConfig) -> FleetConfig:
        """The config this loop runs with, its inputs checked at load (see :func:`orchestrator.loops.prepare`):
        the task's data read and checked, a loop that scores samples needs a reward, and every user reward
        function is called once on a sample of the task."""
        check_rewards(cfg)
        return cfg

    @classmethod
    def roles(cls, cfg: FleetConfig) -> Roles:
        """The actors this loop uses (:func:`orchestrator.rl.fleet.training_roles`): RL generates every step."""
        return training_roles(cfg, generates=True)

    def start(self, fleet: Fleet | None = None) -> None:
        """Create the run directory and start the loop's fleet, or have ``fleet`` serve this run
        (:meth:`orchestrator.rl.fleet.Fleet.serve`)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        if self.resume_from:
            self.start_step = ckpt.load_state(self.resume_from)["step"]
        self.status = RunStatus(self.run_dir)
        self.metrics = MetricsLogger(self.run_dir, self.cfg.run.plot_every, keep_before=self.start_step,
                                     loggers=self.cfg.run.loggers, params=self.cfg.model_dump(mode="json"))
        roles = self.roles(self.cfg)
        self.console.print(f"fleetrl: starting the actors ({', '.join(roles.names())}); their output goes to "
                           f"{self.run_dir / 'logs'}/")
        probe = (self.task.train_batch(0, 1), self.pad_id)
        self.fleet = Fleet.for_run(fleet, self.cfg, roles, self.judge, probe)
        self.startup_s = time.perf_counter() - self.t_config
        log.info("actors up %.1fs after the config was loaded: %s", self.startup_s, self.fleet.describe())
        for line in banner(self.cfg, self.fleet.describe(), self.dashboard, self.startup_s):
            self.console.print(line)
        slow = slow_bf16_warning(self.cfg)
        if slow:
            log.warning(slow)
            self.console.print(f"fleetrl: warning: {slow}")
        if self.resume_from:
            self.restore(self.resume_from)

    def restore(self, path: Path) -> None:
        """Learner (and critic) state from a checkpoint; the engines get the restored weights before generating."""
        state = ckpt.load_state(path)
        self.fleet.learner.load_checkpoint(str(path / "learner"))
        if self.fleet.critic:
            self.fleet.critic.load_checkpoint(str(path / "critic"))
        self.version = state["policy_version"]
        if self.fleet.weight_sync:  # engines serve the restored weights as the checkpoint's version
            self.version -= 1
            self.push_weights()
        in_flight = ckpt.load_in_flight(path)
        if in_flight is not None:  # one_step_off: the next step trains on the batch the checkpoint had in flight
            self.prefetch = Future()
            self.prefetch.set_result(InFlight(in_flight, PhaseTimer()))
        self.console.print(f"resumed from {path} at step {self.start_step} (policy version {self.version})")

    def save_checkpoint(self, next_step: int) -> float:
        """Write a complete checkpoint for resuming at ``next_step``; returns seconds taken."""
        t0 = time.perf_counter()
        stage = ckpt.staging_dir(self.run_dir, next_step)
        try:
            self.fleet.learner.save_checkpoint(str(stage / "learner"))
            if self.fleet.critic:
                self.fleet.critic.save_checkpoint(str(stage / "critic"))
            self.fleet.learner.save_hf(str(stage / "policy"))
            if self.prefetch is not None:  # one_step_off: generated and scored already (train_step waited)
                ckpt.save_in_flight(stage, self.prefetch.result().batch)
            ckpt.commit(self.run_dir, stage, next_step, {"step": next_step, "policy_version": self.version},
                        dump_config(self.cfg), self.cfg.trainer.keep_checkpoints)
        except (OSError, RuntimeError) as e:  # a full disk surfaces as OSError or as torch.save's RuntimeError
            shutil.rmtree(stage, ignore_errors=True)
            previous = ckpt.complete_checkpoints(self.run_dir)
            free_mb = shutil.disk_usage(self.run_dir).free / 2**20
            raise CheckpointFailed(
                f"checkpoint at step {next_step} failed ({str(e).splitlines()[-1][:200]}); {free_mb:.1f} MB free "
                f"on {self.run_dir} (is the disk full?); the previous checkpoint "
                f"{previous[-1] if previous else '(none)'} is intact") from e
        return time.perf_counter() - t0

    def run(self, fleet: Fleet | None = None) -> list[dict]:
        """The loop; a run that fails says so in its status (``fleetrl status``). Without ``fleet`` the loop starts
        its own and stops it at the end; a given fleet stays up (another run can use it)."""
        try:
            return self._loop(fleet)
        except BaseException as e:
            if self.status is not None:
                self.status.finish("failed")
            if not isinstance(e, LearnerDied):
                raise
            found = ckpt.complete_checkpoints(self.run_dir)
            hint = (f"resume with `fleetrl train ... --resume auto` (newest complete checkpoint: {found[-1]})"
                    if found else "no checkpoint was written yet, so it cannot resume: restart it "
                    "(trainer.save_every makes runs resumable)")
            raise LearnerDied(f"{e}. The run stopped; {hint}") from e
        finally:
            if fleet is None and self.fleet is not None:
                self.fleet.stop()

    def _loop(self, fleet: Fleet | None) -> list[dict]:
        self.start(fleet)
        total, budget = self.cfg.trainer.total_steps, self.cfg.trainer.time_budget_s
        t0 = time.perf_counter()
        save_every, bad_steps = self.cfg.trainer.save_every, 0
        self.console.start(total, self.start_step)
        for step in range(self.start_step, total + 1):
            last = (step == total or self.stop_requested
                    or (budget is not None and time.perf_counter() - t0 > budget))
            metrics = {"step": step, "policy_version": self.version}
            if self._is_eval_step(step) or (last and self.cfg.trainer.eval_every):
                metrics.update(self.evaluate(step))
            if not last:
                result = self.train_step(step)
                metrics.update(result.metrics)
                if step == self.start_step:  # this process's first step: what a user waits for after submitting
                    metrics.update({"time/startup_s": self.startup_s,
                                    "time/first_step_s": time.perf_counter() - self.t_config})
                bad_steps = self._count_bad_step(result, metrics, bad_steps)
                if save_every and (step + 1) % save_every == 0 and not bad_steps:
                    metrics["time/checkpoint_s"] = self.save_checkpoint(step + 1)
                self._warn(step, result, bad_steps)
            self.metrics.log(metrics)
            self.fleet.controller.report.remote(metrics)
            self.status.step(metrics)
            self.console.step(metrics)
            if last:
                break
        self.console.close()
        self.finish(time.perf_counter() - t0)
        return self.metrics.history

    def _warn(self, step: int, result: StepResult, bad_steps: int) -> None:
        """The per-step warnings that matter on the console: a skipped update, failed reward calls."""
        if result.skipped_update:
            log.warning("step %d: update skipped (NaN/Inf loss or gradient), %d in a row (the run stops at "
                        "trainer.max_bad_steps=%d)", step, bad_steps, self.cfg.trainer.max_bad_steps)
        if result.reward_errors:
            log.warning("step %d: %d reward-function calls raised or timed out and scored 0 (tracebacks in %s)",
                        step, result.reward_errors, self.run_dir / "logs" / "reward-*.log")

    def _check_reward_errors(self, step: int, batch: Collected) -> None:
        """More than ``reward.max_error_frac`` of a step's reward-function calls failing stops the run with the
        first failure, before any update on the zeros they scored."""
        limit, frac = self.cfg.reward.max_error_frac, batch.info["reward/error_frac"]
        if frac > limit:
            raise RewardsFailing(f"step {step}: {frac:.0%} of the reward-function calls failed (reward.max_error_frac="
                                 f"{limit}); first: {batch.first_error} (tracebacks in {self.run_dir / 'logs'}/"
                                 "reward-*.log)")

    def _count_bad_step(self, result: StepResult, metrics: dict, bad_steps: int) -> int:
        """A step whose update was skipped for a NaN/Inf gradient is bad; too many in a row stop the run."""
        bad_steps = bad_steps + 1 if result.skipped_update else 0
        metrics["train/bad_steps_in_a_row"] = bad_steps
        if bad_steps >= self.cfg.trainer.max_bad_steps:
            self.metrics.log(metrics)
            found = ckpt.complete_checkpoints(self.run_dir)
            raise BadTraining(f"{bad_steps} steps in a row had a NaN/Inf loss or gradient (update skipped each "
                              f"time; trainer.max_bad_steps={self.cfg.trainer.max_bad_steps}); the run stopped. "
                              f"Last good checkpoint: {found[-1] if found else 'none'}")
        return bad_steps

    def finish(self, train_seconds: float) -> None:
        """Final policy, plot, and a summary with each actor's peak memory."""
        final = self.run_dir / "final"
        self.fleet.learner.save_hf(str(final))
        self.metrics.close()
        summary = {**self.summary(), "train_seconds": round(train_seconds, 1)}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.status.finish("finished")
        log.info("final policy written to %s; summary %s", final, summary)
        first, last = summary["eval_accuracy_first"], summary["eval_accuracy_last"]
        evals = f"; held-out accuracy {first:.3f} -> {last:.3f}" if first is not None else ""
        self.console.print(f"done: {summary['steps']} steps in {train_seconds / 60:.1f} min{evals}; final policy "
                           f"{final}, summary {self.run_dir / 'summary.json'}")

    def summary(self) -> dict:
        """``summary.json`` (a loop adds its own keys): steps, start-up, held-out accuracy, each actor's peak RSS."""
        evals = [m["eval/accuracy"] for m in self.metrics.history if "eval/accuracy" in m]
        steps = self.metrics.history[-1]["step"] if self.metrics.history else 0
        # this process's (a resumed run's history also holds the first process's)
        first_step = next((m["time/first_step_s"] for m in reversed(self.metrics.history)
                           if "time/first_step_s" in m), None)
        return {"steps": steps, "startup_s": _round(self.startup_s), "first_step_s": _round(first_step),
                "algorithm": self.cfg.algorithm.name, "eval_accuracy_first": evals[0] if evals else None,
                "eval_accuracy_last": evals[-1] if evals else None, "peak_rss_mb": self.fleet.peak_rss()}

    def _is_eval_step(self, step: int) -> bool:
        every = self.cfg.trainer.eval_every
        return every > 0 and step % every == 0

    def train_step(self, step: int) -> StepResult:
        timer = PhaseTimer()
        collected = self.rollout_batch(step, timer)
        scored = collected.scored
        staleness = self._check_staleness(scored)
        if self.cfg.run.dump_rollouts:
            self._dump(step, scored)
        batch = self._to_batch(scored)
        with timer("logprobs"):
            if self.separate_logprob_pass():
                batch = self.fleet.learner.compute_logprobs(batch)
            else:  # old logprobs come from the update's first pass, the reference pass is fused into it
                batch.old_logprobs = None
            if self.fleet.critic:
                batch.old_values = self.fleet.critic.compute_values(batch)
        with timer("advantages"):
            steps = self.step_rewards(scored) if self.cfg.uses_process_rewards else None
            batch.advantages, batch.returns = self.advantages(scored, batch, steps)
        with timer("learn"):
            update = self.learn(batch)
            train_metrics = update.metrics
        with timer("rollout_wait"):  # one_step_off: the engines finish the next batch before they reload
            queued = self._wait_prefetch()
        self.apply_scaling()
        with timer("sync"):
            sync_metrics = self.push_weights()
        out = {**self._rollout_metrics(scored, batch, collected.reward_errors, train_metrics, staleness),
               **learner_metrics(train_metrics), **sync_metrics, **collected.info,
               **self._timing(timer, train_metrics, queued)}
        if steps is not None:
            present = steps[1] >= 0
            out["process/step_reward_mean"] = float(steps[0][present].mean())
            out["process/steps_per_sample"] = float(present.sum(1).float().mean())
        out["throughput/tokens_per_s"] = out["tokens_generated"] / out["time/step_s"]
        out["throughput/samples_per_s"] = len(scored) / out["time/step_s"]
        return StepResult(out, update.skipped, collected.reward_errors)

    def rollout_batch(self, step: int, timer: PhaseTimer) -> Collected:
        """The step's scored groups. ``sync``: generated now. ``one_step_off``: the batch generated during the
        previous step (generated now only at the first step or after a resume), and generation of the next
        batch starts at once with the current weights, concurrently with this step's update."""
        if self.prefetch is None:
            out = self.collect(step, timer)
        else:
            done = self.prefetch.result()
            self.prefetch, out = None, done.batch
            for phase, seconds in done.timer.seconds.items():
                timer.seconds[f"{phase}_overlapped"] = seconds
        if self.cfg.rollout.mode == "one_step_off" and step + 1 < self.cfg.trainer.total_steps:
            self.prefetch = self.pool.submit(self._collect_timed, step + 1)
        return out

    def _collect_timed(self, step: int) -> InFlight:
        timer = PhaseTimer()
        return InFlight(self.collect(step, timer), timer)

    def _wait_prefetch(self) -> int:
        """Block until the in-flight batch is generated and scored; returns how many prompts it holds."""
        if self.prefetch is None:
            return 0
        return len({x.sample.prompt_uid for x in self.prefetch.result().batch.scored})

    def separate_logprob_pass(self) -> bool:
        """Whether old/reference logprobs need their own forward pass before the update (see learner.logprob_pass):
        only when the batch is used more than once, or PPO needs them for its KL-shaped rewards before the update."""
        c = self.cfg
        used_once = c.learner.epochs == 1 and c.learner.num_minibatches == 1 and not c.algorithm.uses_critic
        return c.learner.logprob_pass == "always" or not used_once

    def _check_staleness(self, scored: list[ScoredSample]) -> int:
        """How many versions the oldest sample lags the learner; past ``rollout.max_staleness`` is an error."""
        oldest = min(x.sample.policy_version for x in scored)
        if self.version - oldest > self.cfg.rollout.max_staleness:
            raise RuntimeError(f"samples from policy version {oldest} reached the learner at version {self.version}:"
                               f" more than rollout.max_staleness={self.cfg.rollout.max_staleness} behind")
        return self.version - oldest

    def apply_scaling(self) -> None:
        """Resize the rollout and reward pools to what `fleetrl scale` asked for (nothing is in flight here), and
        note a `fleetrl stop` request."""
        import ray

        want = ray.get(self.fleet.controller.desired.remote())
        if want["stop"] and not self.stop_requested:
            log.info("stop requested (fleetrl stop): ending after this step with a final eval and the final policy")
            self.stop_requested = True
        self.fleet.rollouts.resize(want["rollout"])
        self.fleet.rewards.resize(want["reward"])
        if self.fleet.envs is not None:
            self.fleet.envs.heal()
            self.fleet.envs.resize(want["env"])

    def _timing(self, timer: PhaseTimer, train_metrics: dict, queued: int) -> dict:
        """Phase times, throughput, and ``time/overhead_s``: step time not spent generating (engines) or in the
        learner's forward/backward/optimizer. In one_step_off those two overlap, so only the longer counts."""
        out = timer.metrics()
        learner_s = out.get("time/logprobs_s", 0.0) + max(train_metrics.get("time/actor_compute_s", 0.0),
                                                          train_metrics.get("time/critic_compute_s", 0.0))
        if self.cfg.rollout.mode == "one_step_off":
            gen = out.get("time/generate_s", 0.0) + out.get("time/generate_overlapped_s", 0.0)
            busy = max(gen, learner_s + out.get("time/rollout_wait_s", 0.0))
        else:
            busy = out.get("time/generate_s", 0.0) + learner_s
        out["time/overhead_s"] = max(0.0, out["time/step_s"] - busy)
        out["rollout/queue_depth"] = queued
        return out

    def _dump(self, step: int, scored: list[ScoredSample]) -> None:
        out = self.run_dir / "rollouts"
        out.mkdir(exist_ok=True)
        rows = [{"uid": x.sample.prompt_uid, "j": x.sample.sample_index, "worker": x.sample.worker,
                 "policy_version": x.sample.policy_version, "prompt": x.sample.prompt_text,
                 "prompt_ids": x.sample.prompt_ids, "completion": x.sample.completion_text,
                 "completion_ids": x.sample.completion_ids, "finish_reason": x.sample.finish_reason,
                 "reward": x.reward, "components": x.components, "loss_mask": x.sample.loss_mask,
                 "episode": dataclasses.asdict(x.sample.episode) if x.sample.episode else None} for x in scored]
        (out / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def collect(self, step: int, timer: PhaseTimer) -> Collected:
        """Generate and score the step's groups. With ``rollout.dynamic_sampling`` (DAPO), groups whose rewards
        are all equal (zero advantage) are set aside and more prompts are sampled, up to
        ``rollout.max_sampling_rounds`` rounds; a batch still short is topped up with set-aside groups."""
        cfg, G = self.cfg, self.cfg.rollout.group_size
        need, kept, spare, errors, rounds, judge_errors = cfg.data.prompts_per_step, [], [], 0, 0, 0
        timeouts = self.fleet.rewards.timeouts
        while len(kept) < need and rounds < (cfg.rollout.max_sampling_rounds if cfg.rollout.dynamic_sampling else 1):
            prompts = self.task.train_batch(step, need, round_=rounds)
            with timer("generate"):
                samples = self.fleet.rollouts.generate(prompts, G, cfg.rollout.temperature,
                                                 seed=cfg.rollout.seed * 100_003 + step + 7919 * rounds)
            with timer("reward"):
                scored, errs, judge_errs = self.fleet.rewards.score_judged(samples, prompts)
            errors += errs
            judge_errors += judge_errs
            rounds += 1
            for g in range(len(prompts)):
                group = scored[g * G: (g + 1) * G]
                informative = not cfg.rollout.dynamic_sampling or len({x.reward for x in group}) > 1
                (kept if informative else spare).append(group)
        groups = (kept + spare)[:need]
        calls = rounds * need * G * max(1, len(cfg.reward.functions) - bool(cfg.judge_spec))
        timed_out = self.fleet.rewards.timeouts - timeouts
        info = {"sampling/rounds": rounds, "sampling/informative_groups": len(kept),
                "reward/error_frac": (errors + timed_out) / calls, "reward/timeouts": timed_out,
                **({"reward/judge_errors": judge_errors} if self.judge else {})}
        if cfg.env.name:
            info["env/dropped_groups"] = drop_errored_groups(groups) if cfg.env.errored == "drop_group" else 0
        out = Collected([x for grp in groups for x in grp], errors, info, self.fleet.rewards.first_error)
        self._check_reward_errors(step, out)
        return out

    def learn(self, batch: TrainBatch) -> Update:
        """Actor update, and the critic's beside it (both groups run concurrently)."""
        refs = self.fleet.learner.train_async(batch)
        critic_refs = self.fleet.critic.train_async(batch) if self.fleet.critic else []
        actor = gather_update(refs)
        if not critic_refs:
            return actor
        critic = gather_update(critic_refs, "critic", role="critic")
        return Update({**actor.metrics, **critic.metrics}, actor.skipped or critic.skipped)

    def step_rewards(self, scored: list[ScoredSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Process supervision: cut each completion into steps (at tokens whose text holds the step separator)
        and score every step. With ``prm.path``: the PRM's step scores times ``prm.process_weight`` (for GRPO-style
        methods the outcome reward is added on the last step, so the steps carry all the credit; PPO already has
        it on the last token); else the reward functions on every step's prefix. Returns ``(step_rewards [B, S],
        step_ends [B, S])`` with -1 ends for absent steps."""
        sep = process_separator(self.cfg)
        ends = [step_ends([self.tokenizer.decode([t]) for t in x.sample.completion_ids], sep) for x in scored]
        if self.fleet.prm is not None:
            values = iter(self._prm_step_rewards(scored, ends))
        else:
            prefixes = [dataclasses.replace(x.sample, completion_text=self.tokenizer.decode(
                x.sample.completion_ids[: e + 1], skip_special_tokens=True)) for x, es in zip(scored, ends)
                for e in es]
            values = iter([r.reward for r in self.fleet.rewards.score(prefixes)[0]])
        S = max(1, max(len(e) for e in ends))
        step_rewards = torch.zeros(len(scored), S)
        end_index = torch.full((len(scored), S), -1, dtype=torch.long)
        for i, es in enumerate(ends):
            for k, e in enumerate(es):
                step_rewards[i, k], end_index[i, k] = next(values), e
        return step_rewards, end_index

    def _prm_step_rewards(self, scored: list[ScoredSample], ends: list[list[int]]) -> list[float]:
        """Flat per-step rewards from the PRM, in (sample, step) order."""
        items = []
        for x, es in zip(scored, ends):
            ids, starts = x.sample.completion_ids, [0] + [e + 1 for e in es[:-1]]
            items.append((x.sample.prompt_text, [self.tokenizer.decode(ids[a: b + 1], skip_special_tokens=True)
                                                 for a, b in zip(starts, es)]))
        scores = self.fleet.prm.score(items)
        w, outcome = self.cfg.prm.process_weight, not self.cfg.algorithm.uses_critic
        out = []
        for x, per_step in zip(scored, scores):
            values = [w * v for v in per_step]
            if outcome and values:
                values[-1] += x.reward
            out += values
        return out

    def advantages(self, scored: list[ScoredSample], batch: TrainBatch, steps=None):
        """Per-token (advantages, returns) from the configured algorithm (:mod:`learner.algorithms`)."""
        turns = [(x.sample.episode.turn_ends, x.sample.episode.turn_rewards) for x in scored] \
            if self.cfg.env.name else None
        inputs = advantage_inputs([s.reward for s in scored], [s.components for s in scored],
                                  [s.sample.prompt_uid for s in scored], batch.response_mask, values=batch.old_values,
                                  old_logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs, steps=steps,
                                  turns=turns)
        return assemble_advantages(self.cfg.algorithm, inputs)

    def push_weights(self) -> dict:
        """Learner -> every rollout engine, in place; the policy version advances."""
        self.version += 1
        return self.fleet.weight_sync.push(self.version)

    def evaluate(self, step: int) -> dict:
        """Greedy held-out accuracy through the rollout engines; the completions and their verdicts go to
        ``<run.dir>/evals/step_<step>.jsonl``, ``trainer.show_samples`` of them to the console and the trackers."""
        t0, timeouts = time.perf_counter(), verify_timeouts()
        if self.engines_stale:
            self.push_weights()
            self.engines_stale = False
        samples = self.fleet.rollouts.generate(self.eval_prompts, 1, temperature=0.0, seed=None)
        correct = self.correct(samples)
        records = eval_records(samples, correct)
        write_eval_samples(self.run_dir, step, records)
        examples = shown(records, self.cfg.trainer.show_samples)
        self.metrics.log_samples(examples, step)
        for r in examples:
            self.console.print(sample_line(step, r))
        restating = sum(r["restates_prompt"] for r in records) / len(records)
        out = {"eval/accuracy": sum(correct) / len(correct), "eval/restate_frac": restating,
               "eval/verify_timeouts": verify_timeouts() - timeouts,
               "time/eval_s": time.perf_counter() - t0}
        if self.cfg.env.name:
            out.update(eval_episode_metrics(samples))
        return out

    def correct(self, samples: list) -> list[bool]:
        """Whether each sample is correct by the task's verifier (accuracy metrics)."""
        return verdicts(self.task.verifier_fn, [(s.prompt_text, s.completion_text, s.metadata) for s in samples])

    def _pool_metrics(self) -> dict:
        """Each generating pool's size and its replacements (``faults/*``)."""
        f, out = self.fleet, {}
        for role, pool in (("rollout", f.rollouts), ("reward", f.rewards), ("env", f.envs)):
            if pool is not None:
                out[f"{role}/workers"] = len(pool.workers)
                out[f"faults/{role}_restarts"] = pool.restarts
                if role != "env":
                    out[f"faults/{role}_recovery_s"] = pool.recovery_s
        return out

    def _to_batch(self, scored: list[ScoredSample]) -> TrainBatch:
        return samples_to_batch([x.sample for x in scored], self.pad_id, self.cfg.algorithm.mask_truncated)

    def _rollout_metrics(self, scored: list[ScoredSample], batch: TrainBatch, reward_errors: int,
                         train_metrics: dict, staleness: int) -> dict:
        rewards = torch.tensor([s.reward for s in scored])
        correct = self.correct([x.sample for x in scored])
        mask = batch.response_mask.bool()
        if "actor/rollout_logprob_gap_max" in train_metrics:  # measured in the update's first pass
            diff = torch.tensor([train_metrics["actor/rollout_logprob_gap_max"]])
        elif batch.old_logprobs is not None:
            diff = (batch.old_logprobs - batch.rollout_logprobs).abs()[mask]
        else:
            diff = torch.zeros(0)
        lengths = torch.tensor([len(x.sample.completion_ids) for x in scored], dtype=torch.float32)
        components = {f"reward/{name}": sum(x.components.get(name, 0.0) for x in scored) / len(scored)
                      for name in sorted({k for x in scored for k in x.components})}
        return {**components, **(episode_metrics([x.sample for x in scored]) if self.cfg.env.name else {}),
            "reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "reward/errors": reward_errors, "train/accuracy": sum(correct) / len(correct),
            "train/restate_frac": restate_frac([x.sample for x in scored]),
            "tokens_generated": int(lengths.sum()), "response/length_mean": lengths.mean().item(),
            "response/truncated_frac": sum(x.sample.finish_reason == "length" for x in scored) / len(scored),
            # |learner - engine| logprob of the batch's tokens: rounding for samples of the current version, plus
            # the updates since for older ones (one_step_off), which the truncated IS weighs. Whether the push
            # arrived is weight_sync/logprob_max_diff (orchestrator/rl/weight_sync.py), in every mode.
            "rollout/logprob_gap_max": diff.max().item() if diff.numel() else 0.0,
            "rollout/policy_version_min": min(x.sample.policy_version for x in scored),
            "rollout/staleness_max": staleness,
            "rollout/samples": len(scored), "rollout/unique_prompts": len({x.sample.prompt_uid for x in scored}),
            **self._pool_metrics(),
        }


@dataclasses.dataclass
class StepResult:
    """What a loop's training step returns: its metrics, and what the loop acts on, typed (not read back from
    metric names): whether the update was skipped for a NaN/Inf gradient, and failed reward-function calls."""

    metrics: dict
    skipped_update: bool = False
    reward_errors: int = 0


@dataclasses.dataclass
class InFlight:
    """one_step_off: the next step's batch, generated and scored while this step trains, and its phase times."""

    batch: Collected
    timer: PhaseTimer


class CheckpointFailed(RuntimeError):
    """A checkpoint could not be written; the previous one is untouched."""


class BadTraining(RuntimeError):
    """Too many consecutive steps with non-finite gradients."""


class RewardsFailing(RuntimeError):
    """Too many of a step's reward-function calls failed (``reward.max_error_frac``)."""


def check_rewards(cfg: FleetConfig) -> None:
    """The task (a dataset's rows read and checked), a reward to train on, and each user reward function (an
    import path) called once on a training prompt with its reference answer as the completion: a ConfigError
    naming it when it raises, hangs or returns no number."""
    from orchestrator.config import ConfigError
    from rewards.functions import preflight_reward_function
    from rewards.judge import NAME

    r = cfg.reward
    if not r.functions and not r.model.path:
        raise ConfigError("reward.functions: empty, and no reward.model.path: a run that samples needs a reward "
                          "(e.g. [{name: math}])")
    task = make_task(cfg)  # a dataset's rows are read and checked here
    users = [f for f in r.functions if ":" in f.name and f.name != NAME]
    if not users:
        return
    prompt = task.train_batch(0, 1)[0]
    sample = (prompt.text, str(prompt.metadata.get("answer", "")), prompt.metadata)
    for f in users:
        try:
            preflight_reward_function(f.name, f.params, sample)
        except ValueError as e:
            raise ConfigError(f"reward.functions[{r.functions.index(f)}]: {e}") from None


def samples_to_batch(samples: list, pad_id: int, mask_truncated: bool = False) -> TrainBatch:
    """Samples in the learner's layout, padded with the tokenizer's ``pad_id`` (masks, not the pad id, say what is
    real). ``mask_truncated``: a completion cut at the length cap (finish reason ``length``) gets no loss; it
    still counts as a sequence in the loss's per-sequence normalizers and its reward in its group's baseline."""
    batch = build_batch([x.prompt_ids for x in samples], [x.completion_ids for x in samples],
                        [x.logprobs for x in samples], pad_id, [x.loss_mask for x in samples])
    if mask_truncated:
        batch.response_mask[torch.tensor([x.finish_reason == "length" for x in samples])] = 0.0
    return batch


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def learner_metrics(m: dict) -> dict:
    """Learner metrics under their role prefix, plus the short names the run summary uses."""
    out = dict(m)
    out["loss"] = m.get("actor/loss", float("nan"))
    out["kl"] = m.get("actor/kl", float("nan"))
    out["clip_frac"] = m.get("actor/clip_frac", float("nan"))
    out["entropy"] = m.get("actor/entropy", float("nan"))
    return out


def run_training(cfg: FleetConfig, resume: str | None = None, loop: type | None = None,
                 fleet: Fleet | None = None) -> list[dict]:
    """Check the inputs, join or start Ray, then run the loop (``loop``: default the config's, :func:`orchestrator.
    recipes.loop_for`) on its own fleet, or on ``fleet`` (kept up after the run). The driver's own log goes to
    ``<run.dir>/logs/driver.log``."""
    from orchestrator.loops import loop_for

    loop = loop or loop_for(cfg)
    cfg = loop.prepare(cfg)
    if resume:
        ckpt.resolve(resume, Path(cfg.run.dir))  # a broken checkpoint is named before anything is written
    if fleet is None and not (cfg.run.ray_address or os.environ.get("RAY_ADDRESS")):
        check_this_machine(cfg, loop.roles(cfg))  # a private instance: cores and memory, before Ray starts
    console = Console(verbose=cfg.run.verbose)
    console.setup_logging(Path(cfg.run.dir))
    # the loop (its imports, task and tokenizer) before Ray: a Ray job's driver loses its working directory once it
    # joins the cluster (its files are unpacked again while its first actors start), and transformers and torch
    # read it when they are first imported; so are the modules the run imports lazily while its actors start
    trainer = loop(cfg, resume, console)
    preload_driver_modules()
    trainer.dashboard = init_ray(cfg)
    if fleet is None:
        check_resources(cfg, loop.roles(cfg))  # GPUs or resources the cluster lacks: refused before any actor
    return trainer.run(fleet)


DRIVER_MODULES = ("orchestrator.ops.trackers", "orchestrator.ops.controller", "orchestrator.rl.weight_sync",
                  "orchestrator.evaluation.samples", "workers.weight_buckets", "workers.nccl_sync")
"""Modules a training run imports lazily while its fleet starts (:func:`preload_driver_modules`)."""


def preload_driver_modules() -> None:
    """Import :data:`DRIVER_MODULES` now: a Ray job's driver that imports them after joining the cluster can find
    its working directory's files gone for a moment (test_cluster: ``No module named 'orchestrator.ops.trackers'``
    from the two-node cluster's job)."""
    import importlib

    for name in DRIVER_MODULES:
        importlib.import_module(name)
