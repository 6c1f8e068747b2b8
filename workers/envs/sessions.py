"""Agent sessions: the exact tokens of a conversation that agent code drives through the OpenAI-compatible
endpoint (:mod:`workers.envs.endpoint`).

A session is one agent run: one sample of a GRPO group. Every chat-completions call sends the whole conversation
so far. The session finds the trajectory whose conversation the call extends (the messages it was sent, then the
reply it returned, compared as an OpenAI client echoes them) and appends only the new messages, rendered by the
chat template after the ids the engine sampled (:meth:`ChatTemplateRenderer.after_turn`, the tool episodes'
renderer): the history is never decoded and re-tokenized. A call that extends no trajectory (the client edited
or stripped an earlier reply, or sent other tools) starts a new trajectory from a fresh rendering of its
messages: a **fork**, counted, never re-aligned; the earlier trajectory is dropped. A call that repeats the last
call's messages exactly is a **retry** when the client says so (the ``openai`` SDKs' ``X-Stainless-Retry-Count``
header above 0) or does not say (no header): it replaces that call's turn, one sample, no orphan; sent again on
purpose (the header at 0) it is a **branch**: a new trajectory from the same exact ids, counted as a fork. The
trajectory a call extended last is the session's sample; its loss mask is 1 exactly on the
sampled ids, and each turn records the policy version its request was sent with.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from dataclasses import dataclass, field

from workers.envs.api import ToolCall
from workers.envs.episode import Episode
from workers.envs.renderers import ChatTemplateRenderer

_UNSET = object()

MAX_CHARS_PER_TOKEN = 16
"""A call whose messages, tool-call arguments and tools hold more than ``env.max_total_tokens`` times this many
characters cannot fit the session's context (no tokenizer averages 16 characters per token on text): it is refused
(400) before anything is rendered or tokenized, so a huge message does not hold the loop that steps the engine."""


class BadRequest(ValueError):
    """A request the endpoint answers with HTTP 400; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SessionLimits:
    max_turns: int  # chat-completions calls per session (env.max_turns)
    max_total_tokens: int  # prompt + turns + observations (env.max_total_tokens)
    max_new_tokens: int  # per call (rollout.max_new_tokens); a request's max_tokens is clamped to it


def _text(content) -> str:
    """OpenAI message content (a string, None, or a list of parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest("only text content parts are supported", "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadRequest(f"message content must be a string or a list of text parts, not {type(content).__name__}",
                     "messages")


def _arguments(raw) -> dict:
    """A tool call's arguments, sent as a JSON string (the OpenAI wire format) or a dict."""
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except (TypeError, ValueError):
        raise BadRequest(f"tool call arguments are not JSON: {str(raw)[:80]!r}", "messages") from None
    if not isinstance(value, dict):
        raise BadRequest("tool call arguments must be a JSON object", "messages")
    return value


def normalize(message) -> tuple:
    """What identifies a message when the client echoes it back (extra fields an SDK adds are ignored); a message
    of the wrong shape is a :class:`BadRequest`."""
    if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool",
                                                                      "developer"):
        raise BadRequest("each message needs a role of system, developer, user, assistant or tool", "messages")
    raw = message.get("tool_calls") or []
    if not isinstance(raw, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str | None) and isinstance(
            c.get("function"), dict) and isinstance(c["function"].get("name"), str) for c in raw):
        raise BadRequest('tool_calls must be a list of {"id": string, "function": {"name": string, "arguments": '
                         'JSON string}} objects', "messages")
    if not all(isinstance(message.get(k), str | None) for k in ("tool_call_id", "name")):
        raise BadRequest("a message's tool_call_id and name must be strings", "messages")
    calls = tuple((c.get("id"), c["function"]["name"], json.dumps(_arguments(c["function"].get("arguments")),
                                                                  sort_keys=True)) for c in raw)
    return (message["role"], _text(message.get("content")), calls, message.get("tool_call_id"))


@dataclass
class Trajectory:
    """One linear chain of calls: the exact ids so far and the conversation as the client sees it."""

    episode: Episode
    conversation: list[dict]  # as the template renders it (assistant turns: the sampled text)
    seen: list[tuple]  # the normalized client messages this trajectory stands for, ending with the last reply
    last_input: list[tuple] | None = None  # the last call's messages (a retry repeats them)
    undo: tuple | None = None  # the state before the last call's turn
    last_sampled: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token: the policy version that sampled it (else -1)
    forked: bool = False  # started by a call that extended no earlier trajectory of the session
    fresh: bool = False  # started by the call in progress (taken back whole if that call gets no reply)

    def snapshot(self) -> tuple:
        return copy.deepcopy((self.episode, self.conversation, self.seen, self.last_sampled, self.versions))

    def restore(self, state: tuple) -> None:
        self.episode, self.conversation, self.seen, self.last_sampled, self.versions = copy.deepcopy(state)


class Session:
    """One agent run's calls (see the module docstring). ``prepare`` then ``record`` per call."""

    def __init__(self, sid: str, tokenizer, limits: SessionLimits, system_prompt: str | None = None,
                 renderer: ChatTemplateRenderer | None = None):
        """``renderer``: one already built for ``tokenizer`` (its template checked once), copied: a session sets
        its own tools on it."""
        self.sid, self.tokenizer, self.limits, self.system_prompt = sid, tokenizer, limits, system_prompt
        self.renderer = copy.copy(renderer) if renderer else ChatTemplateRenderer(tokenizer, None, system_prompt)
        self.inline_calls = "tool_calls" not in (tokenizer.chat_template or "")
        self.trajectories: list[Trajectory] = []
        self.current: Trajectory | None = None
        self.tools: list | None | object = _UNSET  # the tools of the trajectories' renderings
        self.counts: Counter = Counter()
        self.calls = 0

    # -- one call -------------------------------------------------------------------------------------------
    def prepare(self, messages: list, tools: list | None, retry: bool | None = None) -> tuple[Trajectory, int]:
        """The trajectory this call continues (extended, replayed, branched or new) and the most tokens it may
        sample. ``retry``: whether the client says the call is a retry of one it sent (None: it does not say)."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        if self.calls >= self.limits.max_turns:
            raise BadRequest(f"this session has made its {self.limits.max_turns} calls (env.max_turns)", "messages")
        keys = [normalize(m) for m in messages]
        chars = sum(len(text) + sum(len(c[2]) for c in calls) for _, text, calls, _ in keys) + len(json.dumps(tools))
        if chars > self.limits.max_total_tokens * MAX_CHARS_PER_TOKEN:
            raise BadRequest(f"the messages hold {chars} characters: more than env.max_total_tokens="
                             f"{self.limits.max_total_tokens} tokens can hold", "messages")
        traj = self._continue(messages, keys, tools, retry)
        self.calls += 1
        budget = self.limits.max_total_tokens - len(traj.episode.token_ids)
        if budget <= 0:
            self._undo(traj)
            raise BadRequest(f"the conversation has {len(traj.episode.token_ids)} tokens: no room left in "
                             f"env.max_total_tokens={self.limits.max_total_tokens}", "messages")
        self.current = traj
        return traj, min(budget, self.limits.max_new_tokens)

    def record(self, traj: Trajectory, ids: list[int], logprobs: list[float], text: str, finish_reason: str,
               version: int, parse_calls: bool) -> dict:
        """Append the engine's turn to ``traj``; returns the assistant message for the client."""
        ep = traj.episode
        ep.append(list(ids), list(logprobs))
        traj.versions += [version] * len(ids)
        ep.turn_ends.append(len(ep.token_ids) - 1)
        ep.turn_texts.append(text)
        ep.turn_rewards.append(0.0)
        ep.finish_reason = finish_reason
        traj.last_sampled = list(ids)
        traj.conversation.append({"role": "assistant", "content": text})
        calls = self.renderer.tool_calls(text) if parse_calls else []
        message = self._reply(text, calls, finish_reason)
        ep.tool_calls += len(message.get("tool_calls") or ())
        ep.tools_called += [c["function"]["name"] for c in message.get("tool_calls") or ()]
        traj.seen = [*traj.last_input, normalize(message)]
        traj.fresh = False
        return message

    def abandon(self, traj: Trajectory) -> None:
        """Undo a prepared call that got no reply (the client disconnected, the engine failed): no trace of it."""
        self.counts["aborted"] += 1
        self._undo(traj)

    def _undo(self, traj: Trajectory) -> None:
        """Take back a prepared call: the trajectory as it was before it (one it started is removed)."""
        self.calls -= 1
        if traj.fresh:  # the call had started this trajectory
            self.trajectories.remove(traj)
            self.counts["forks"] -= traj.forked
            self.current = self.trajectories[-1] if self.trajectories else None
            return
        traj.restore(traj.undo)
        traj.last_input, traj.undo = None, None

    def episode(self) -> Episode:
        """The session's sample: the trajectory extended last (an empty episode if no call was made)."""
        ep = self.current.episode if self.current else Episode()
        ep.messages = list(self.current.conversation) if self.current else []
        ep.info.update({f"agent/{k}": v for k, v in self.counts.items()})
        return ep

    # -- internals --------------------------------------------------------------------------------------------
    def _continue(self, messages: list, keys: list[tuple], tools: list | None, retry: bool | None) -> Trajectory:
        if self.tools is not _UNSET and tools != self.tools:
            return self._fork(messages, keys, tools)
        for traj in reversed(self.trajectories):
            if traj.last_input == keys and traj.undo is not None:  # the last call again
                if retry is False:  # on purpose: a branch from the same ids
                    traj = self._branch(traj)
                else:  # a retry: redo the last turn
                    traj.restore(traj.undo)
                    self.counts["retries"] += 1
                return self._extend(traj, messages, keys, len(traj.seen))
            n = len(traj.seen)
            if keys[:n] == traj.seen and len(keys) > n and all(k[0] != "assistant" for k in keys[n:]):
                return self._extend(traj, messages, keys, n)
        return self._fork(messages, keys, tools)

    def _extend(self, traj: Trajectory, messages: list, keys: list[tuple], n: int) -> Trajectory:
        traj.undo = traj.snapshot()
        if n:  # after a reply: the new messages' ids, after the sampled turn's (never a re-tokenization)
            new = self._canonical(messages[n:], messages)
            appended = self.renderer.after_turn(traj.conversation, traj.last_sampled, new)
            traj.episode.append(appended)
            traj.episode.observation_tokens += len(appended)
            traj.versions += [-1] * len(appended)
            traj.conversation += new
        traj.last_input = keys
        return traj

    def _branch(self, parent: Trajectory) -> Trajectory:
        """A new trajectory at ``parent``'s state before its last call (the same exact ids), counted as a fork."""
        episode, conversation, seen, last_sampled, versions = copy.deepcopy(parent.undo)
        traj = Trajectory(episode, conversation, seen, last_sampled=last_sampled, versions=versions, forked=True,
                          fresh=True)
        self.counts["forks"] += 1
        self.trajectories.append(traj)
        return traj

    def _fork(self, messages: list, keys: list[tuple], tools: list | None) -> Trajectory:
        forked = bool(self.trajectories)
        self.counts["forks"] += forked
        self.tools = tools
        self.renderer.tools = tools or None
        conversation = self.renderer.conversation(self._canonical(messages, messages))
        ep = Episode()
        ep.append(self.renderer.initial(conversation))
        ep.prompt_len = len(ep.token_ids)
        traj = Trajectory(ep, conversation, [], versions=[-1] * len(ep.token_ids), forked=forked, fresh=True)
        self.trajectories.append(traj)
        return self._extend(traj, messages, keys, 0)

    def _canonical(self, new: list, history: list) -> list[dict]:
        """Client messages as the chat template renders them: text content; a tool result named by its call; an
        assistant message that is not one of this session's replies with its calls as hermes text when the
        template has no ``tool_calls`` of its own."""
        names = {c.get("id"): c.get("function", {}).get("name") for m in history
                 for c in (m.get("tool_calls") or ()) if isinstance(c, dict)}
        out = []
        for m in new:
            role, content = m["role"], _text(m.get("content"))
            if role == "developer":
                role = "system"
            if role == "tool":
                out.append({"role": "tool", "name": m.get("name") or names.get(m.get("tool_call_id")) or "tool",
                            "content": content})
            elif role == "assistant" and m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
                         for c in m["tool_calls"]]
                if self.inline_calls:
                    content += "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
                    out.append({"role": "assistant", "content": content})
                else:
                    out.append({"role": "assistant", "content": content,
                                "tool_calls": [{"type": "function", "function": c} for c in calls]})
            else:
                out.append({"role": role, "content": content})
        return out

    def _reply(self, text: str, calls: list[ToolCall], finish_reason: str) -> dict:
        """The OpenAI assistant message of a turn: hermes ``<tool_call>`` blocks as ``tool_calls`` (ids unique in
        the session); a turn with a call that is not valid JSON is returned as plain text."""
        if not calls or any(c.name == "invalid" for c in calls):
            return {"role": "assistant", "content": text}
        content = ChatTemplateRenderer.CALL.sub("", text).strip() or None
        return {"role": "assistant", "content": content, "tool_calls": [
            {"id": f"call_{self.sid}_{self.calls}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for i, c in enumerate(calls)]}
