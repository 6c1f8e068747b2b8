"""The rollout actor's side of multi-turn episodes (``env.name`` or ``env.agent`` set): make each episode's
environment (or agent run, :mod:`workers.envs.agent`), run all of a call's episodes concurrently on the actor's
engine (:mod:`workers.engine_loop`), and turn each into a :class:`Sample` whose completion is everything after the
prompt (turns, observations, glue) with its loss mask.

For the reward actors a sample's ``completion_text`` is the episode's last assistant turn (its answer) and
``metadata["messages"]`` the whole conversation."""

from __future__ import annotations

import contextlib

from workers.envs.api import load_environment
from workers.envs.episode import Episode, EpisodeLimits, run_episode
from workers.envs.remote import RemoteEnv
from workers.envs.renderers import ChatTemplateRenderer, TextRenderer
from workers.envs.tool_env import env_tools, make_environment
from workers.records import EpisodeStats, Sample


class EpisodeFactory:
    """Environments, renderer and limits of one ``env`` config section (a dict: it crosses the actor boundary).
    With ``env_actors`` (the ``env-i`` actors of ``env.num_workers``) each episode's environment lives in one of
    them, chosen round-robin."""

    def __init__(self, env: dict, tokenizer, max_new_tokens: int, env_actors: list | None = None, name: str = "",
                 version=lambda: 0):
        self.env, self.env_actors, self.name = env, list(env_actors or []), name
        self.agent = None
        if env.get("agent"):
            from workers.envs.agent import AgentRunner

            self.tools = []
            self.agent = AgentRunner(env, tokenizer, max_new_tokens, {}, name)
            self.renderer = ChatTemplateRenderer(tokenizer, None, env.get("system_prompt"))
        else:
            self.tools = env_tools(env)
            self.env_class = load_environment(env["name"])  # fails here, clearly, before any episode starts
            chat = env["renderer"] == "chat" or (env["renderer"] == "auto" and getattr(tokenizer, "chat_template",
                                                                                     None))
            self.renderer = ChatTemplateRenderer(tokenizer, self.tools, env.get("system_prompt")) if chat else \
                TextRenderer(tokenizer)
        self.version = version  # the actor's policy version now (stamped on an agent's calls when sent)
        self.next_actor = 0  # round robin over env_actors
        self.limits = EpisodeLimits(env["max_turns"], env["max_tool_calls"], env["max_total_tokens"], max_new_tokens,
                                    env["episode_timeout_s"])
        self.tokenizer = tokenizer

    def make_env(self):
        if self.env_actors:
            self.next_actor += 1
            return RemoteEnv(self.env_actors[self.next_actor % len(self.env_actors)], self.name)
        return make_environment(self.env)

    def serving(self, temperature: float, top_p: float):
        """An async context around a call's episodes: an agent's endpoint is served inside it."""
        if self.agent is None:
            return contextlib.nullcontext()
        self.agent.endpoint.sampling = {"temperature": temperature, "top_p": top_p}
        return self.agent.serving()

    def episode(self, prompt, metadata: dict, seed: int | None, turn_seed):
        """A callable ``generate -> coroutine`` (see :func:`workers.engine_loop.run_all`)."""
        if self.agent is not None:
            return self.agent.episode(prompt, metadata, self.version, turn_seed)
        task = {**metadata, "prompt": prompt}

        def start(generate):
            turns = iter(range(self.limits.max_turns))

            async def gen(ids, max_new_tokens):
                return await generate(ids, max_new_tokens, turn_seed(next(turns)))

            return run_episode(self.make_env(), self.renderer, task, seed or 0, self.limits, gen)

        return start

    def to_sample(self, ep: Episode, uid: str, j: int, metadata: dict, version: int, worker: str) -> Sample:
        P = ep.prompt_len
        stats = EpisodeStats(
            termination=ep.termination, turns=len(ep.turn_texts), tool_calls=ep.tool_calls,
            tool_errors=ep.tool_errors, tool_seconds=ep.tool_seconds, observation_tokens=ep.observation_tokens,
            leaked_turns=sum(self.renderer.leaked(t) for t in ep.turn_texts),
            turn_ends=[e - P for e in ep.turn_ends], turn_rewards=ep.turn_rewards, errored=ep.errored,
            tools_called=ep.tools_called, counters={k: v for k, v in ep.info.items() if k.startswith("agent/")})
        limited = ep.termination in ("max_total_tokens", "truncated") and ep.finish_reason == "length"
        return Sample(
            prompt_uid=uid, sample_index=j, prompt_text=self.tokenizer.decode(ep.token_ids[:P]),
            prompt_ids=ep.token_ids[:P], completion_ids=ep.token_ids[P:], logprobs=ep.logprobs[P:],
            completion_text=ep.turn_texts[-1] if ep.turn_texts else "", finish_reason="length" if limited else "stop",
            policy_version=version, metadata={**metadata, "messages": ep.messages, "termination": ep.termination},
            worker=worker, loss_mask=ep.mask[P:], episode=stats)
