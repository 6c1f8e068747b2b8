"""The step's view of multi-turn episodes: dropping the groups an environment failed in, and the ``env/*``
metrics. Pure Python over the samples the rollout actors returned."""

from __future__ import annotations

from workers.envs.episode import LIMITED
from workers.records import ScoredSample


def drop_errored_groups(groups: list[list[ScoredSample]]) -> int:
    """Groups holding an errored episode (the environment raised, or the episode timed out) get zero loss: their
    advantages never reach the gradient and their rewards never another group's baseline (baselines are per
    group). Returns how many groups were dropped."""
    dropped = 0
    for group in groups:
        if any(x.sample.episode is not None and x.sample.episode.errored for x in group):
            dropped += 1
            for x in group:
                x.sample.loss_mask = [0] * len(x.sample.completion_ids)
    return dropped


def episode_return(x: ScoredSample) -> float:
    """What a sample is trained on: the reward functions' score plus, for a multi-turn episode, every turn's reward
    from its environment (an agent's own return sits on its last turn): the sum the advantages are computed from
    (:func:`learner.algorithms.advantage_inputs`)."""
    return x.reward + (sum(x.sample.episode.turn_rewards) if x.sample.episode is not None else 0.0)


def episode_metrics(samples: list) -> dict:
    """Per-step numbers of multi-turn episodes (``env/*``)."""
    eps = [s.episode for s in samples]
    n, calls, turns = len(eps), sum(e.tool_calls for e in eps), sum(e.turns for e in eps)
    latency = sorted(t for e in eps for t in e.tool_seconds)
    completion = sum(len(s.completion_ids) for s in samples)
    out = {"env/tool_call_rate": sum(e.tool_calls > 0 for e in eps) / n,
           "env/tool_calls_mean": calls / n, "env/tool_error_rate": sum(e.tool_errors for e in eps) / max(calls, 1),
           "env/turns_mean": turns / n,
           "env/tokens_mean": sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples) / n,
           "env/observation_token_frac": sum(e.observation_tokens for e in eps) / max(completion, 1),
           "env/truncated_frac": sum(e.termination in LIMITED for e in eps) / n,
           "env/errored_frac": sum(e.errored for e in eps) / n,
           "env/leak_rate": sum(e.leaked_turns for e in eps) / max(turns, 1)}
    chosen = [(e.tools_called[0], s.metadata["tool"]) for s, e in zip(samples, eps)
              if e.tools_called and "tool" in s.metadata]
    if chosen:  # a task that names each problem's tool (tool_choice): of the episodes that called one, the right one
        out["env/right_tool_rate"] = sum(called == right for called, right in chosen) / len(chosen)
    if any(e.counters for e in eps):
        out.update(agent_metrics(eps))
    for reason in sorted({e.termination for e in eps}):
        out[f"env/termination/{reason}"] = sum(e.termination == reason for e in eps) / n
    if latency:
        out["env/tool_latency_p50_s"] = latency[len(latency) // 2]
        out["env/tool_latency_p99_s"] = latency[min(len(latency) - 1, int(0.99 * len(latency)))]
    return out


AGENT_COUNTERS = ("forks", "retries", "aborted", "bad_requests", "overridden", "unclaimed")


def agent_metrics(eps: list) -> dict:
    """Agent episodes (``env.agent``): runs that raised (``agent/errors``) or ran out of time (``agent/timeouts``),
    and the endpoint's counts summed over the step's sessions (forked histories, client retries, calls the client
    abandoned, requests answered 400, sampling settings answered with the run's, runs no agent outside the fleet
    claimed)."""
    out = {"agent/errors": sum(e.termination == "env_error" for e in eps),
           "agent/timeouts": sum(e.termination == "timeout" for e in eps),
           "agent/calls_mean": sum(e.counters.get("agent/calls", 0) for e in eps) / len(eps)}
    for key in AGENT_COUNTERS:
        out[f"agent/{key}"] = sum(e.counters.get(f"agent/{key}", 0) for e in eps)
    return out


EVAL_KEYS = ("tool_call_rate", "right_tool_rate", "tool_error_rate", "leak_rate", "errored_frac")


def eval_episode_metrics(samples: list) -> dict:
    """The greedy eval's view of its episodes: ``eval/tool_call_rate``, ``eval/right_tool_rate`` (tasks that name
    each problem's tool), ``eval/tool_error_rate``, ``eval/leak_rate``, ``eval/errored_frac``."""
    step = episode_metrics(samples)
    return {f"eval/{k}": step[f"env/{k}"] for k in EVAL_KEYS if f"env/{k}" in step}
