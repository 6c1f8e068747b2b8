"""The RL loop: one step of policy-gradient training, read top to bottom as the algorithm, each phase timed
(:meth:`PolicyLoop.train_step`):

    generate -> score -> (learner logprobs) -> advantages -> update -> push weights

The driver around it (evals, checkpoints, bad steps, status, summary) is :class:`orchestrator.rl.driver.Run`.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import torch

from learner.algorithms import advantage_inputs, assemble_advantages
from learner.batch import TrainBatch
from learner.corrections import logprob_gap_stats, reject
from orchestrator.config import FleetConfig
from orchestrator.rl.collect import mask_invalid_rewards, samples_to_batch
from orchestrator.rl.driver import Loop, Run, StepOutcome, learner_metrics
from orchestrator.rl.episode_metrics import episode_metrics, episode_return
from orchestrator.rl.fleet import Roles, training_roles
from orchestrator.rl.launch import make_task
from orchestrator.rl.reasoning_steps import process_separator, step_ends
from orchestrator.telemetry.metrics import PhaseTimer
from orchestrator.telemetry.samples import restate_frac
from workers.records import ScoredSample

log = logging.getLogger("fleetrl")


class PolicyLoop(Loop):
    """The RL step (policy gradients: the GRPO family, PPO with its critic, GDPO, RLOO, online process rewards):

        generate -> score -> (learner logprobs) -> advantages -> update -> push weights

    The batch comes from the run's rollout source (:mod:`orchestrator.rl.rollout_source`: ``sync``, ``one_step_off``,
    ``async``)."""

    def __init__(self, run: Run):
        super().__init__(run)
        self.cfg = run.cfg

    @classmethod
    def prepare(cls, cfg: FleetConfig) -> FleetConfig:
        """The task's data read and checked, a loop that scores samples needs a reward, and every user reward
        function called once on a sample of the task (:func:`check_rewards`)."""
        check_rewards(cfg)
        if cfg.algorithm.uses_teacher:
            check_same_tokenizer(cfg)
        if cfg.env.agent:
            check_agent_template(cfg)
        return cfg

    @classmethod
    def roles(cls, cfg: FleetConfig) -> Roles:
        """The actors this loop uses (:func:`orchestrator.rl.fleet.training_roles`): RL generates every step."""
        return training_roles(cfg, generates=True)

    def train_step(self, step: int) -> StepOutcome:
        timer = PhaseTimer()
        collected = self.run.source.take(step, timer)
        scored = collected.scored
        collected.info["reward/invalid_samples"] = mask_invalid_rewards(scored)  # before the batch takes the masks
        staleness = self._check_staleness(scored)
        batch = self._to_batch(scored)
        teacher, per_sample = None, None
        if self.run.fleet.teacher is not None:
            with timer("teacher"):
                per_sample = self.run.fleet.teacher.token_logprobs([x.sample for x in scored])
            teacher = response_layout(per_sample, batch)
        if self.cfg.run.dump_rollouts:
            self._dump(step, scored, per_sample)
        with timer("logprobs"):
            if separate_logprob_pass(self.cfg):
                batch = self.run.fleet.learner.compute_logprobs(batch)
            else:  # old logprobs come from the update's first pass, the reference pass is fused into it
                batch.old_logprobs = None
            if self.run.fleet.critic:
                batch.old_values = self.run.fleet.critic.compute_values(batch)
        with timer("advantages"):
            steps = self.step_rewards(scored) if self.cfg.uses_process_rewards else None
            batch.advantages, batch.returns = self.advantages(scored, batch, steps, teacher)
        actor_batch, off_policy = self._reject(batch)
        with timer("learn"):  # async: finished samples are taken and scored meanwhile
            update = self.run.learn(actor_batch, critic_batch=batch)
            train_metrics = update.metrics
        sync_metrics, queued = self.run.sync_weights(timer)
        out = {**self._rollout_metrics(scored, batch, collected.reward_errors, train_metrics, staleness),
               **learner_metrics(train_metrics), **off_policy, **sync_metrics, **collected.info,
               **self._timing(timer, train_metrics, queued)}
        if teacher is not None:
            out.update(distill_metrics(teacher, batch))
        if steps is not None:
            present = steps[1] >= 0
            out["process/step_reward_mean"] = float(steps[0][present].mean())
            out["process/steps_per_sample"] = float(present.sum(1).float().mean())
        out["throughput/tokens_per_s"] = out["tokens_generated"] / out["time/step_s"]
        out["throughput/samples_per_s"] = len(scored) / out["time/step_s"]
        return StepOutcome(out, update.skipped, collected.reward_errors)

    def _check_staleness(self, scored: list[ScoredSample]) -> int:
        """How many versions the oldest sample lags the learner; past ``rollout.max_staleness`` is an error."""
        oldest, version = min(x.sample.policy_version for x in scored), self.run.version
        if version - oldest > self.cfg.rollout.max_staleness:
            raise RuntimeError(f"samples from policy version {oldest} reached the learner at version {version}:"
                               f" more than rollout.max_staleness={self.cfg.rollout.max_staleness} behind")
        return version - oldest

    def _timing(self, timer: PhaseTimer, train_metrics: dict, queued: int) -> dict:
        """Phase times, throughput, and ``time/overhead_s``: step time not spent generating (engines) or in the
        learner's forward/backward/optimizer. In one_step_off those two overlap, so only the longer counts."""
        out = timer.metrics()
        learner_s = out.get("time/logprobs_s", 0.0) + out.get("time/teacher_s", 0.0) + max(
            train_metrics.get("time/actor_compute_s", 0.0), train_metrics.get("time/critic_compute_s", 0.0))
        out.update(self.run.source.metrics(out))
        out["time/overhead_s"] = max(0.0, out["time/step_s"] - self.run.source.busy_s(out, learner_s))
        out["rollout/queue_depth"] = queued
        return out

    def _dump(self, step: int, scored: list[ScoredSample], teacher: list[list[float]] | None = None) -> None:
        out = self.run.run_dir / "rollouts"
        out.mkdir(exist_ok=True)
        rows = [{"uid": x.sample.prompt_uid, "j": x.sample.sample_index, "worker": x.sample.worker,
                 "policy_version": x.sample.policy_version, "prompt": x.sample.prompt_text,
                 "prompt_ids": x.sample.prompt_ids, "completion": x.sample.completion_text,
                 "completion_ids": x.sample.completion_ids, "finish_reason": x.sample.finish_reason,
                 "token_versions": x.sample.token_versions,
                 "reward": x.reward, "components": x.components, "loss_mask": x.sample.loss_mask,
                 "episode": dataclasses.asdict(x.sample.episode) if x.sample.episode else None,
                 **({} if teacher is None else {"teacher_logprobs": teacher[i]})}
                for i, x in enumerate(scored)]
        (out / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def step_rewards(self, scored: list[ScoredSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Process supervision: cut each completion into steps (at tokens whose text holds the step separator)
        and score every step. With ``prm.path``: the PRM's step scores times ``prm.process_weight`` (for GRPO-style
        methods the outcome reward is added on the last step, so the steps carry all the credit; PPO already has
        it on the last token); else the reward functions on every step's prefix. Returns ``(step_rewards [B, S],
        step_ends [B, S])`` with -1 ends for absent steps."""
        sep = process_separator(self.cfg)
        ends = [step_ends([self.run.tokenizer.decode([t]) for t in x.sample.completion_ids], sep) for x in scored]
        if self.run.fleet.prm is not None:
            values = iter(self._prm_step_rewards(scored, ends))
        else:
            prefixes = [dataclasses.replace(x.sample, completion_text=self.run.tokenizer.decode(
                x.sample.completion_ids[: e + 1], skip_special_tokens=True)) for x, es in zip(scored, ends)
                for e in es]
            values = iter([r.reward for r in self.run.fleet.rewards.score(prefixes)[0]])
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
            items.append((x.sample.prompt_text, [self.run.tokenizer.decode(ids[a: b + 1], skip_special_tokens=True)
                                                 for a, b in zip(starts, es)]))
        scores = self.run.fleet.prm.score(items)
        w, outcome = self.cfg.prm.process_weight, not self.cfg.algorithm.uses_critic
        out = []
        for x, per_step in zip(scored, scores):
            values = [w * v for v in per_step]
            if outcome and values:
                values[-1] += x.reward
            out += values
        return out

    def advantages(self, scored: list[ScoredSample], batch: TrainBatch, steps=None,
                   teacher: torch.Tensor | None = None):
        """Per-token (advantages, returns) from the configured algorithm (:mod:`learner.algorithms`); ``teacher``:
        the teacher's logprobs of the sampled tokens (on-policy distillation)."""
        turns = [(x.sample.episode.turn_ends, x.sample.episode.turn_rewards) for x in scored] \
            if self.cfg.env.multi_turn else None
        inputs = advantage_inputs([s.reward for s in scored], [s.components for s in scored],
                                  [s.sample.prompt_uid for s in scored], batch.response_mask, values=batch.old_values,
                                  old_logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs, steps=steps,
                                  turns=turns)
        if teacher is not None:
            inputs = dataclasses.replace(inputs, rollout_logprobs=batch.rollout_logprobs, teacher_logprobs=teacher)
        return assemble_advantages(self.cfg.algorithm, inputs)

    def _pool_metrics(self) -> dict:
        """Each generating pool's size and its replacements (``faults/*``)."""
        f, out = self.run.fleet, {}
        for role, pool in (("rollout", f.rollouts), ("reward", f.rewards), ("env", f.envs), ("teacher", f.teacher)):
            if pool is not None:
                out[f"{role}/workers"] = len(pool.workers)
                out[f"faults/{role}_restarts"] = pool.restarts
                if role != "env":
                    out[f"faults/{role}_recovery_s"] = pool.recovery_s
        return out

    def _reject(self, batch: TrainBatch) -> tuple[TrainBatch, dict]:
        """The actor's batch: the tokens ``algorithm.rejection`` drops removed from its response mask (so from the
        loss's global counts too), and the ``off_policy/*`` metrics; the batch itself without a rejection."""
        a = self.cfg.algorithm
        if a.rejection == "none":
            return batch, {}
        assert batch.old_logprobs is not None  # separate_logprob_pass: a rejection needs them before the update
        mask, metrics = reject(a.rejection, batch.old_logprobs, batch.rollout_logprobs, batch.response_mask,
                               *a.rejection_band)
        return dataclasses.replace(batch, response_mask=mask), metrics

    def _to_batch(self, scored: list[ScoredSample]) -> TrainBatch:
        return samples_to_batch([x.sample for x in scored], self.run.pad_id, self.cfg.algorithm.mask_truncated)

    def _rollout_metrics(self, scored: list[ScoredSample], batch: TrainBatch, reward_errors: int,
                         train_metrics: dict, staleness: int) -> dict:
        rewards = torch.tensor([episode_return(s) for s in scored])  # an environment's or agent's rewards included
        correct = self.run.correct([x.sample for x in scored])
        mask = batch.response_mask.bool()
        if batch.old_logprobs is not None:  # every sampled token (an off-policy rejection's dropped ones too)
            gap = logprob_gap_stats(batch.old_logprobs, batch.rollout_logprobs, mask)
        elif "actor/rollout_logprob_gap_max" in train_metrics:  # measured in the update's first pass
            m = train_metrics
            gap = {"max": m["actor/rollout_logprob_gap_max"], "p99": m["actor/rollout_logprob_gap_p99_max"],
                   "mean": m["actor/rollout_logprob_gap_sum"] / max(m["actor/rollout_logprob_gap_tokens"], 1.0)}
        else:
            gap = {"max": 0.0, "p99": 0.0, "mean": 0.0}
        lengths = torch.tensor([len(x.sample.completion_ids) for x in scored], dtype=torch.float32)
        components = {f"reward/{name}": sum(x.components.get(name, 0.0) for x in scored) / len(scored)
                      for name in sorted({k for x in scored for k in x.components})}
        if self.cfg.env.multi_turn:  # the environment's (or agent's) share of reward/mean
            components["env/reward_mean"] = sum(episode_return(x) - x.reward for x in scored) / len(scored)
        return {**components, **(episode_metrics([x.sample for x in scored]) if self.cfg.env.multi_turn else {}),
            "reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "reward/errors": reward_errors, "train/accuracy": sum(correct) / len(correct),
            "train/restate_frac": restate_frac([x.sample for x in scored]),
            "tokens_generated": int(lengths.sum()), "response/length_mean": lengths.mean().item(),
            "response/truncated_frac": sum(x.sample.finish_reason == "length" for x in scored) / len(scored),
            # |learner - engine| logprob of the batch's tokens: rounding for samples of the current version, plus
            # the updates since for older ones (one_step_off), which the truncated IS weighs. Whether the push
            # arrived is weight_sync/logprob_max_diff (orchestrator/rl/weight_sync.py), in every mode.
            # (p99: exact from a separate logprob pass, else the micro-batches' largest p99, a bound)
            **{f"rollout/logprob_gap_{k}": v for k, v in gap.items()},
            "rollout/policy_version_min": min(x.sample.policy_version for x in scored),
            "rollout/staleness_max": staleness,
            "rollout/samples": len(scored), "rollout/unique_prompts": len({x.sample.prompt_uid for x in scored}),
            **self._pool_metrics(),
        }


def check_rewards(cfg: FleetConfig) -> None:
    """The task (a dataset's rows read and checked), a reward to train on, and each user reward function (an
    import path) called once on a training prompt with its reference answer as the completion: a ConfigError
    naming it when it raises, hangs or returns no number."""
    from orchestrator.config import ConfigError
    from rewards.functions import preflight_reward_function
    from rewards.judge import NAME

    r = cfg.reward
    if not r.functions and not r.model.path and not cfg.env.agent:
        raise ConfigError("reward.functions: empty, and no reward.model.path or env.agent: a run that samples needs a "
                          "reward (e.g. [{name: math}])")
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


def response_layout(per_sample: list[list[float]], batch: TrainBatch) -> torch.Tensor:
    """``[B, T]``: one value per completion token of each sample (a teacher's logprobs), in the batch's response
    layout, 0 where the response mask is."""
    out = torch.zeros_like(batch.rollout_logprobs)
    for i, values in enumerate(per_sample):
        out[i, : len(values)] = torch.tensor(values, dtype=out.dtype)
    return out * batch.response_mask


def distill_metrics(teacher: torch.Tensor, batch: TrainBatch) -> dict:
    """On-policy distillation: ``distill/reverse_kl``, the mean over trained tokens of ``log pi_student -
    log pi_teacher`` (the per-token reverse KL estimate; 0 when the student is the teacher), its largest token and
    the teacher's mean logprob."""
    mask = batch.response_mask.bool()
    gap = (batch.rollout_logprobs - teacher)[mask]
    return {"distill/reverse_kl": gap.mean().item() if gap.numel() else 0.0,
            "distill/reverse_kl_max": gap.abs().max().item() if gap.numel() else 0.0,
            "distill/teacher_logprob_mean": teacher[mask].mean().item() if gap.numel() else 0.0}


def check_same_tokenizer(cfg: FleetConfig) -> None:
    """On-policy distillation scores the student's token ids with the teacher: ``distill.teacher`` must be a model
    directory whose tokenizer is the student's (vocabulary and special tokens), a ConfigError otherwise (the
    embedded student's tokenizer is known before it is built)."""
    from orchestrator.config import ConfigError
    from orchestrator.rl.launch import check_teacher, load_tokenizer

    teacher = check_teacher(cfg)
    student_tok, teacher_tok = load_tokenizer(cfg.model.path), load_tokenizer(str(teacher))
    if student_tok.get_vocab() != teacher_tok.get_vocab() or \
            student_tok.all_special_tokens != teacher_tok.all_special_tokens:
        raise ConfigError(f"distill.teacher: {teacher}'s tokenizer ({len(teacher_tok)} tokens) is not model.path's "
                          f"({len(student_tok)} tokens): on-policy distillation scores the student's token ids with "
                          "the teacher, so both need the same tokenizer (offline `fleetrl distill` does not)")


def check_agent_template(cfg: FleetConfig) -> None:
    """An agent talks to the model through its chat template, which must keep earlier turns as they were rendered
    (exact tokens per session): a ConfigError naming ``env.agent`` and ``model.path`` otherwise."""
    from orchestrator.config import ConfigError
    from orchestrator.rl.launch import load_tokenizer
    from workers.envs.renderers import TemplateNotPrefixPreserving, check_prefix_preserving
    from workers.prompts import use_chat_template

    tok = use_chat_template(load_tokenizer(cfg.model.path), cfg.data.chat_template)
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"env.agent={cfg.env.agent}: the tokenizer of model.path={cfg.model.path} has no chat "
                          "template (an agent's messages are rendered by it)")
    try:
        check_prefix_preserving(tok)
    except TemplateNotPrefixPreserving as e:
        raise ConfigError(f"env.agent={cfg.env.agent}: {e}") from None


def separate_logprob_pass(cfg: FleetConfig) -> bool:
    """Whether old/reference logprobs need their own forward pass before the update (see learner.logprob_pass):
    only when the batch is used more than once, PPO needs them for its KL-shaped rewards before the update, or an
    off-policy rejection (``algorithm.rejection``) compares them with the engines' before the update."""
    c = cfg
    used_once = c.learner.epochs == 1 and c.learner.num_minibatches == 1 and not c.algorithm.uses_critic
    return c.learner.logprob_pass == "always" or not used_once or c.algorithm.rejection != "none"
