"""The driver every training loop runs under (the single controller). :class:`Run` does what all loops do: start
or join the fleet, the eval cadence, checkpoints and resume, bad steps, the run status, metrics, the final policy
and ``summary.json``. A loop (:class:`Loop`: RL's :class:`orchestrator.loops.policy.PolicyLoop`, SFT, DPO, the
reward model, the PRM, RFT) holds its run and says what one training step is; the driver holds the loop.

    run = Run(cfg, PolicyLoop)      # the loop is chosen once, from the algorithm's objective (orchestrator.loops)
    run.run(fleet)                  # for each step: eval on the cadence, loop.train_step, checkpoint, status
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from learner.batch import TrainBatch
from orchestrator.config import FleetConfig, dump_config
from orchestrator.rl import checkpoint as ckpt
from orchestrator.rl.doctor import Diagnosis, check_run, diagnose
from orchestrator.rl.episode_metrics import eval_episode_metrics
from orchestrator.rl.fleet import Fleet, Roles, check_resources, check_this_machine
from orchestrator.rl.judge import reward_judge
from orchestrator.rl.launch import ensure_model, init_ray, load_tokenizer, make_task
from orchestrator.rl.learner_group import LearnerDied, Update, gather_update
from orchestrator.rl.pools import AGENT_ENDPOINTS
from orchestrator.rl.rollout_source import RolloutSource, source_class
from orchestrator.telemetry.console import Console, banner, sample_line, slow_bf16_warning
from orchestrator.telemetry.metrics import MetricsLogger, PhaseTimer
from orchestrator.telemetry.run_status import RunStatus
from orchestrator.telemetry.samples import eval_records, shown, write_eval_samples
from rewards.functions import verdicts, verify_timeouts
from workers.prompts import pad_token_id, use_chat_template

log = logging.getLogger("fleetrl")


@dataclasses.dataclass
class StepOutcome:
    """What a loop's training step returns: its metrics, and what the driver acts on, typed (not read back from
    metric names): whether the update was skipped for a NaN/Inf gradient, and failed reward-function calls."""

    metrics: dict
    skipped_update: bool = False
    reward_errors: int = 0
    engines_stale: bool = False
    """The learner was updated without a push (a supervised step): the engines get the weights before they
    generate next (an eval's)."""


class Loop:
    """What a training loop is to the driver: the actors it uses (``roles``), its inputs checked at load
    (``prepare``), and one training step. The defaults: evals through the engines with the task's verifier
    (:meth:`Run.evaluate`), nothing in flight between steps, nothing added to ``final/`` or the summary."""

    def __init__(self, run: Run):
        self.run = run

    @classmethod
    def prepare(cls, cfg: FleetConfig) -> FleetConfig:
        """The config this loop runs with, every input it reads checked (a ConfigError naming the key)."""
        return cfg

    @classmethod
    def roles(cls, cfg: FleetConfig) -> Roles:
        raise NotImplementedError

    def train_step(self, step: int) -> StepOutcome:
        raise NotImplementedError

    def evaluate(self, step: int) -> dict:
        return self.run.evaluate(step)

    def on_final(self, final: Path) -> None:
        """``final/`` holds the trained model: add what serving it needs."""

    def summary(self) -> dict:
        """Keys this loop adds to (or overrides in) ``summary.json``."""
        return {}


class Run:
    """One training run of ``loop`` on a fleet (see the module): its config, console, directory, status and
    metrics, the policy version, and the services every loop uses (:meth:`learn`, :meth:`push_weights`,
    :meth:`evaluate`, :meth:`correct`)."""

    def __init__(self, cfg: FleetConfig, loop: type[Loop], resume: str | None = None,
                 console: Console | None = None):
        self.t_config = time.perf_counter()  # config loaded: time/startup_s and time/first_step_s count from here
        self.startup_s: float | None = None  # -> all actors ready
        self.cfg = cfg
        self.console = console or Console(verbose=cfg.run.verbose)
        self.dashboard: str | None = None  # the Ray dashboard's URL, when there is one
        self.run_dir = Path(cfg.run.dir)
        self.task = make_task(cfg)
        self.eval_prompts = self.task.eval_set(cfg.data.eval_size)
        self.tokenizer = use_chat_template(load_tokenizer(cfg.model.path), cfg.data.chat_template)
        self.pad_id = pad_token_id(self.tokenizer)
        self.version = 0
        self.start_step = 0
        self.engines_stale = False  # a supervised step updated the learner: push before the engines generate
        self.stop_requested = False  # `fleetrl stop`: end at the next step boundary
        self.preempted = False  # SIGTERM: checkpoint and exit at the next step boundary (:func:`on_sigterm`)
        self.last_save = time.perf_counter()  # trainer.save_every_s counts from the last checkpoint (or first step)
        self.resume_from = ckpt.resolve(resume, self.run_dir) if resume else None
        self.judge = None  # the `judge` reward (rewards/judge.py), checked before any actor starts
        if cfg.judge_spec:
            self.judge = reward_judge(cfg)
        self._fleet: Fleet | None = None
        self._source: RolloutSource | None = None
        self._status: RunStatus | None = None
        self._metrics: MetricsLogger | None = None
        self.loop = loop(self)

    @property
    def roles(self) -> Roles:
        return type(self.loop).roles(self.cfg)

    @property
    def fleet(self) -> Fleet:
        assert self._fleet is not None, "the run has not started its fleet"
        return self._fleet

    @property
    def source(self) -> RolloutSource:
        """Where the loop's batches come from (:mod:`orchestrator.rl.rollout_source`), for loops that sample."""
        assert self._source is not None, f"{type(self.loop).__name__} does not sample (its roles have no reward)"
        return self._source

    @property
    def metrics(self) -> MetricsLogger:
        assert self._metrics is not None, "the run has not started"
        return self._metrics

    def probe(self) -> tuple:
        """What the weight-sync probe generates from: one training prompt and the pad id."""
        return self.task.train_batch(0, 1), self.pad_id

    def run(self, fleet: Fleet | None = None) -> list[dict]:
        """The loop; a run that fails says so in its status (``fleetrl status``). Without ``fleet`` the run starts
        its own and stops it at the end; a given fleet stays up (another run can use it)."""
        try:
            return self._steps(fleet)
        except BaseException as e:
            if self._status is not None:
                self._status.finish("preempted" if isinstance(e, Preempted) else "failed")
            if not isinstance(e, LearnerDied):
                raise
            found = ckpt.complete_checkpoints(self.run_dir)
            hint = (f"resume with `fleetrl train ... --resume auto` (newest complete checkpoint: {found[-1]})"
                    if found else "no checkpoint was written yet, so it cannot resume: restart it "
                    "(trainer.save_every_s and trainer.save_every make runs resumable)")
            raise LearnerDied(f"{e}. The run stopped; {hint}") from e
        finally:
            (self.run_dir / AGENT_ENDPOINTS).unlink(missing_ok=True)  # its tokens are dead: agents see the run end
            if self._source is not None:
                self._close_source()
            if fleet is None and self._fleet is not None:
                self._fleet.stop()

    def _close_source(self) -> None:
        try:
            self.source.close()
        except Exception:  # noqa: BLE001 - a failed run's fleet may be gone; the run's own error is what matters
            log.exception("closing the rollout source's hold on the fleet failed")

    def start(self, fleet: Fleet | None = None) -> None:
        """Create the run directory and start the loop's fleet, or have ``fleet`` serve this run
        (:meth:`orchestrator.rl.fleet.Fleet.serve`)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        if self.resume_from:
            self.start_step = ckpt.load_state(self.resume_from)["step"]
        self._status = RunStatus(self.run_dir)
        self._metrics = MetricsLogger(self.run_dir, self.cfg.run.plot_every, keep_before=self.start_step,
                                      loggers=self.cfg.run.loggers, params=self.cfg.model_dump(mode="json"))
        roles = self.roles
        self.console.print(f"fleetrl: starting the actors ({', '.join(roles.names())}); their output goes to "
                           f"{self.run_dir / 'logs'}/")
        self._fleet = Fleet.for_run(fleet, self.cfg, roles, self.judge, self.probe())
        if roles.reward:  # the loop samples: RL, online DPO, RFT
            self._source = source_class(self.cfg)(self)
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
        if self._source is not None:  # one_step_off's batch in flight, async's stream
            self._source.restore(path)
        elif ckpt.load_in_flight(path) is not None:
            raise ValueError(f"{path} holds a batch in flight, but {type(self.loop).__name__} does not sample")
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
            if self._source is not None:  # one_step_off's batch in flight (train_step waited), async's stream
                self._source.save(stage)
            path = ckpt.commit(self.run_dir, stage, next_step, {"step": next_step, "policy_version": self.version},
                               dump_config(self.cfg), self.cfg.trainer.keep_checkpoints)
        except (OSError, RuntimeError) as e:  # a full disk surfaces as OSError or as torch.save's RuntimeError
            shutil.rmtree(stage, ignore_errors=True)
            previous = ckpt.complete_checkpoints(self.run_dir)
            free_mb = shutil.disk_usage(self.run_dir).free / 2**20
            raise CheckpointFailed(
                f"checkpoint at step {next_step} failed ({str(e).splitlines()[-1][:200]}); {free_mb:.1f} MB free "
                f"on {self.run_dir} (is the disk full?); the previous checkpoint "
                f"{previous[-1] if previous else '(none)'} is intact") from e
        self.last_save = time.perf_counter()
        self.console.print(f"checkpoint step {next_step}: {path} ({self.last_save - t0:.2f}s)")
        return self.last_save - t0

    def _steps(self, fleet: Fleet | None) -> list[dict]:
        self.start(fleet)
        if self.start_step == 0 and doctor_applies(self.cfg, self.fleet):  # refuses a mismatched run
            check_run(self)
        total, budget = self.cfg.trainer.total_steps, self.cfg.trainer.time_budget_s
        t0 = self.last_save = time.perf_counter()
        bad_steps = 0
        self.console.start(total, self.start_step)
        for step in range(self.start_step, total + 1):
            last = (step == total or self.stop_requested
                    or (budget is not None and time.perf_counter() - t0 > budget))
            metrics = {"step": step, "policy_version": self.version}
            if self._is_eval_step(step) or (last and self.cfg.trainer.eval_every):
                metrics.update(self.loop.evaluate(step))
                self._keep_best(step, metrics)
            if not last:
                bad_steps = self._train_step(step, metrics, bad_steps)
            self.metrics.log(metrics)
            self.fleet.controller.report.remote(metrics)
            self._status.step(metrics)
            self.console.step(metrics)
            if last:
                break
            if self.preempted:
                self._preempt(step + 1, saved="time/checkpoint_s" in metrics, bad_steps=bad_steps)
        self.console.close()
        self.finish(time.perf_counter() - t0)
        return self.metrics.history

    def _keep_best(self, step: int, metrics: dict) -> None:
        """``trainer.keep_best``: export the evaluated policy as ``best/`` when its metric beats the kept one's
        (written beside, then renamed into place: a crash never leaves half a ``best/``)."""
        key = self.cfg.trainer.keep_best
        if not key or key not in metrics:
            return
        best, t0 = self.run_dir / "best", time.perf_counter()
        kept = best_record(best)
        if kept is not None and metrics[key] <= kept["value"]:
            return
        tmp = self.run_dir / ".best.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.fleet.learner.save_hf(str(tmp))
        self.loop.on_final(tmp)
        (tmp / BEST_RECORD).write_text(json.dumps({"metric": key, "value": metrics[key], "step": step}))
        shutil.rmtree(best, ignore_errors=True)
        tmp.rename(best)
        metrics["time/keep_best_s"] = time.perf_counter() - t0

    def _train_step(self, step: int, metrics: dict, bad_steps: int) -> int:
        """The loop's step, its metrics into ``metrics``, a checkpoint on the cadence; the bad steps in a row."""
        result = self.loop.train_step(step)
        metrics.update(result.metrics)
        if result.engines_stale:
            self.engines_stale = True
        if step == self.start_step:  # this process's first step: what a user waits for after submitting
            metrics.update({"time/startup_s": self.startup_s,
                            "time/first_step_s": time.perf_counter() - self.t_config})
        bad_steps = self._count_bad_step(result, metrics, bad_steps)
        every, every_s = self.cfg.trainer.save_every, self.cfg.trainer.save_every_s
        due = (every and (step + 1) % every == 0) or (every_s and time.perf_counter() - self.last_save >= every_s)
        if due and not bad_steps:
            metrics["time/checkpoint_s"] = self.save_checkpoint(step + 1)
        self._warn(step, result, bad_steps)
        return bad_steps

    def _preempt(self, next_step: int, saved: bool, bad_steps: int) -> None:
        """SIGTERM arrived during the step that just ended: checkpoint it (unless the cadence just did, or its
        update was skipped: checkpoints follow good steps only) and stop the run (:class:`Preempted`)."""
        if not (saved or bad_steps):
            self.save_checkpoint(next_step)
        found = ckpt.complete_checkpoints(self.run_dir)
        where = f"resume with `--resume auto` from {found[-1]}" if found else "no checkpoint to resume from"
        self.console.close()
        self.console.print(f"fleetrl: SIGTERM: stopped after step {next_step - 1}; {where}")
        raise Preempted(f"stopped by SIGTERM after step {next_step - 1}; {where}")

    def _warn(self, step: int, result: StepOutcome, bad_steps: int) -> None:
        """The per-step warnings that matter on the console: a skipped update, failed reward calls."""
        if result.skipped_update:
            log.warning("step %d: update skipped (NaN/Inf loss or gradient), %d in a row (the run stops at "
                        "trainer.max_bad_steps=%d)", step, bad_steps, self.cfg.trainer.max_bad_steps)
        if result.reward_errors:
            log.warning("step %d: %d reward-function calls raised or timed out and scored 0 (tracebacks in %s)",
                        step, result.reward_errors, self.run_dir / "logs" / "reward-*.log")

    def _count_bad_step(self, result: StepOutcome, metrics: dict, bad_steps: int) -> int:
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
        self.loop.on_final(final)
        self.metrics.close()
        summary = {**self.summary(), "train_seconds": round(train_seconds, 1)}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self._status.finish("finished")
        log.info("final policy written to %s; summary %s", final, summary)
        first, last = summary["eval_accuracy_first"], summary["eval_accuracy_last"]
        evals = f"; held-out accuracy {first:.3f} -> {last:.3f}" if first is not None else ""
        self.console.print(f"done: {summary['steps']} steps in {train_seconds / 60:.1f} min{evals}; final policy "
                           f"{final}, summary {self.run_dir / 'summary.json'}")

    def summary(self) -> dict:
        """``summary.json`` (the loop adds its own keys): steps, start-up, the actor groups it reused from the runs
        before it on the same fleet (``fleet_kept``, :meth:`Fleet.serve`), held-out accuracy, each actor's peak
        RSS."""
        evals = [m["eval/accuracy"] for m in self.metrics.history if "eval/accuracy" in m]
        steps = self.metrics.history[-1]["step"] if self.metrics.history else 0
        # this process's (a resumed run's history also holds the first process's)
        first_step = next((m["time/first_step_s"] for m in reversed(self.metrics.history)
                           if "time/first_step_s" in m), None)
        return {"steps": steps, "startup_s": _round(self.startup_s), "first_step_s": _round(first_step),
                "fleet_kept": self.fleet.kept, "algorithm": self.cfg.algorithm.name,
                "model_source": self.cfg.model.source, "data_source": self.cfg.data.source,
                "eval_accuracy_first": evals[0] if evals else None, "eval_accuracy_last": evals[-1] if evals else None,
                "best": best_record(self.run_dir / "best"),
                "peak_rss_mb": self.fleet.peak_rss(),
                **self.loop.summary()}

    def _is_eval_step(self, step: int) -> bool:
        every = self.cfg.trainer.eval_every
        return every > 0 and step % every == 0

    # ---- what every loop uses ---------------------------------------------------------------------------------

    def learn(self, batch: TrainBatch, critic_batch: TrainBatch | None = None) -> Update:
        """Actor update, and the critic's beside it (both groups run concurrently) on ``critic_batch`` when the
        actor's differs (tokens the off-policy rejection dropped from the policy loss still train the values).
        Meanwhile the rollout source's pump is called repeatedly (the asynchronous stream's)."""
        import ray

        while_waiting = self._source.pump() if self._source is not None else None
        refs = self.fleet.learner.train_async(batch)
        critic_refs = self.fleet.critic.train_async(critic_batch or batch) if self.fleet.critic else []
        while while_waiting is not None and ray.wait(refs + critic_refs, num_returns=len(refs + critic_refs),
                                                     timeout=0.2)[1]:
            while_waiting()
        actor = gather_update(refs)
        if not critic_refs:
            return actor
        critic = gather_update(critic_refs, "critic", role="critic")
        return Update({**actor.metrics, **critic.metrics}, actor.skipped or critic.skipped)

    def sync_weights(self, timer: PhaseTimer) -> tuple[dict, int]:
        """After a sampling loop's update: the source's work with the current weights finished (``rollout_wait``),
        `fleetrl scale` and `stop` requests applied, then the push (``sync``). Returns the push's metrics and how
        many prompts wait for the next step."""
        with timer("rollout_wait"):  # one_step_off: the engines finish the next batch before they reload
            queued = self.source.settle()
        self.apply_requests()
        with timer("sync"):
            return self.push_weights(), queued

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
               "eval/verify_timeouts": verify_timeouts() - timeouts}
        if self.cfg.env.multi_turn:
            out.update(eval_episode_metrics(samples))
        if self.cfg.trainer.eval_samples:
            out.update(self._sampled_eval(step, self.cfg.trainer.eval_samples))
        out["time/eval_s"] = time.perf_counter() - t0
        return out

    def _sampled_eval(self, step: int, k: int) -> dict:
        """``trainer.eval_samples``: pass@1 averaged over ``k`` samples of each held-out prompt, and maj@k."""
        from rewards.functions import answer_keys, majority_vote

        samples = self.fleet.rollouts.generate(self.eval_prompts, k, self.cfg.rollout.temperature,
                                               seed=self.cfg.rollout.seed + 7919 * (step + 1))
        correct = self.correct(samples)
        keys = answer_keys(self.task.answer_key, [s.completion_text for s in samples])
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.prompt_uid, []).append(i)
        voted = [majority_vote([keys[i] for i in idx]) for idx in groups.values()]
        majority = [v is not None and correct[idx[v]] for v, idx in zip(voted, groups.values())]
        return {"eval/pass@1": sum(correct) / len(correct), f"eval/maj@{k}": sum(majority) / len(majority)}

    def correct(self, samples: list) -> list[bool]:
        """Whether each sample is correct by the task's verifier (accuracy metrics)."""
        return verdicts(self.task.verifier_fn, [(s.prompt_text, s.completion_text, s.metadata) for s in samples])

    def apply_requests(self) -> None:
        """Resize the rollout and reward pools to what `fleetrl scale` asked for (call it with nothing in flight),
        and note a `fleetrl stop` request."""
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


class CheckpointFailed(RuntimeError):
    """A checkpoint could not be written; the previous one is untouched."""


class BadTraining(RuntimeError):
    """Too many consecutive steps with non-finite gradients."""


class Preempted(RuntimeError):
    """The run was stopped by SIGTERM at a step boundary, its checkpoint written (`fleetrl` exits 143)."""


PREEMPTED_EXIT = 128 + signal.SIGTERM
"""`fleetrl`'s exit status after a SIGTERM (a shell's for a process the signal ended)."""


BEST_RECORD = "fleetrl_best.json"
"""In ``best/`` (``trainer.keep_best``): the metric, its value and the step of the kept policy."""


def best_record(best: Path) -> dict | None:
    """``best/``'s record, or None when no policy has been kept."""
    path = best / BEST_RECORD
    return json.loads(path.read_text()) if path.exists() else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def doctor_applies(cfg: FleetConfig, fleet: Fleet) -> bool:
    """The mismatch doctor (:mod:`orchestrator.rl.doctor`) checks single-turn policy-gradient runs whose learner
    pushes to engines, when ``rollout.max_logprob_gap`` is set."""
    return (cfg.rollout.max_logprob_gap is not None and fleet.weight_sync is not None and not cfg.env.multi_turn
            and cfg.algorithm.sampling_temperature_logprobs)


def learner_metrics(m: dict) -> dict:
    """Learner metrics under their role prefix, plus the short names the run summary uses."""
    out = dict(m)
    out["loss"] = m.get("actor/loss", float("nan"))
    out["kl"] = m.get("actor/kl", float("nan"))
    out["clip_frac"] = m.get("actor/clip_frac", float("nan"))
    out["entropy"] = m.get("actor/entropy", float("nan"))
    return out


def run_training(cfg: FleetConfig, resume: str | None = None, *, loop: type[Loop], fleet: Fleet | None = None,
                 checked: bool = False) -> list[dict]:
    """Check the inputs (``checked``: the caller's ``prepare`` did), join or start Ray, then run ``loop`` (the
    config's is :func:`orchestrator.loops.train`'s) on its own fleet, or on ``fleet`` (kept up after the run).
    The driver's own log goes to ``<run.dir>/logs/driver.log``."""
    if not checked:  # a dataset for the embedded model is measured in its tokenizer's tokens, built or not
        cfg = loop.prepare(cfg)
    if resume:
        ckpt.resolve(resume, Path(cfg.run.dir))  # a broken checkpoint is named before anything is written
    else:
        ckpt.check_new_run_dir(Path(cfg.run.dir))  # an earlier run there is never silently replaced
    if fleet is None and not (cfg.run.ray_address or os.environ.get("RAY_ADDRESS")):
        check_this_machine(cfg, loop.roles(cfg))  # a private instance: cores and memory, before Ray starts
    ensure_model(cfg)  # the embedded model, built when missing: after every check (1.5 min on 2 cores)
    console = Console(verbose=cfg.run.verbose)
    console.setup_logging(Path(cfg.run.dir))
    # the loop (its imports, task and tokenizer) before Ray: a Ray job's driver loses its working directory once it
    # joins the cluster (its files are unpacked again while its first actors start), and transformers and torch
    # read it when they are first imported; so are the modules the run imports lazily while its actors start
    run = Run(cfg, loop, resume, console)
    preload_driver_modules()
    run.dashboard = init_ray(cfg)
    if fleet is None:
        check_resources(cfg, loop.roles(cfg))  # GPUs or resources the cluster lacks: refused before any actor
    with on_sigterm(run):
        return run.run(fleet)


def run_doctor(cfg: FleetConfig, *, loop: type[Loop], fleet: Fleet | None = None) -> Diagnosis:
    """`fleetrl doctor`: ``loop``'s fleet started (in a scratch run dir) or ``fleet`` served, then diagnosed."""
    import tempfile

    ensure_model(cfg)
    with tempfile.TemporaryDirectory(prefix="fleetrl-doctor-") as tmp:
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": tmp})})
        run = Run(cfg, loop)
        init_ray(cfg)
        try:
            run.start(fleet)
            return diagnose(run)
        finally:
            if run._source is not None:
                run._close_source()
            if run._fleet is not None and fleet is None:
                run.fleet.stop()


@contextlib.contextmanager
def on_sigterm(run: Run):
    """While ``run`` runs, SIGTERM (a preempted node) ends it at the next step boundary with a checkpoint
    (:meth:`Run._preempt`); a second SIGTERM kills the process at once. Installed after ``ray.init``, which sets
    its own handler (``sys.exit``); that one is back afterwards. Outside the main thread nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        run.preempted = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log.warning("SIGTERM: stopping after this step with a checkpoint (a second SIGTERM kills the run now)")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


DRIVER_MODULES = ("orchestrator.telemetry.trackers", "orchestrator.telemetry.controller", "orchestrator.rl.weight_sync",
                  "orchestrator.telemetry.samples", "workers.weight_buckets", "workers.nccl_sync")
"""Modules a training run imports lazily while its fleet starts (:func:`preload_driver_modules`)."""


def preload_driver_modules() -> None:
    """Import :data:`DRIVER_MODULES` now: a Ray job's driver that imports them after joining the cluster can find
    its working directory's files gone for a moment (test_cluster: ``No module named 'orchestrator.telemetry.trackers'``
    from the two-node cluster's job)."""
    import importlib

    for name in DRIVER_MODULES:
        importlib.import_module(name)
