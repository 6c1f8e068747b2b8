"""The OpenAI-compatible endpoint a rollout actor serves over its own engine while it runs agent episodes
(``env.agent``): agent code written against the ``openai`` client trains unchanged.

    POST /sessions/{id}/v1/chat/completions     one call of session ``id`` (:mod:`workers.envs.sessions`)
    GET  /sessions/{id}/v1/models, /v1/models   the served model
    GET  /health                                no token needed

With ``env.agent: external`` the agents run outside the fleet and drive their sessions through the control side:

    POST /v1/sessions                           claim a waiting task: its session id, task and base_url
                                                (``{"wait_s": s}`` waits up to s <= 30 seconds; 204: none waiting)
    POST /sessions/{id}/reward                  ``{"reward": number or {name: number}}`` (the last one counts)
    POST /sessions/{id}/finish                  end the session (optionally with ``"reward"``): its sample is done

Served with aiohttp on the actor's episode event loop (the loop that steps the engine,
:mod:`workers.engine_loop`): a call becomes one engine request, batched with every other session's by vLLM's
continuous batching; there is no second inference server. Bound to ``env.endpoint_host`` (loopback by default) on
a free port; every request but ``/health`` needs ``Authorization: Bearer <token>`` (a random token per actor).

Honoured: ``messages``, ``tools`` (rendered by the model's chat template, as tool episodes render them),
``tool_choice`` ``auto`` / ``none``, ``max_tokens`` / ``max_completion_tokens`` (clamped to ``rollout.
max_new_tokens`` and to what ``env.max_total_tokens`` leaves), ``stop``, ``stream`` (the finished reply as
server-sent events). Sampling is the run's (``rollout.temperature``, ``top_p``, the sample's seed): a request that
asks for other settings is answered with the run's and counted (``agent/overridden``). Answered 400 with a message:
``n`` > 1, ``response_format`` other than text, ``tool_choice`` ``required`` or a named function, malformed
messages or ``tool_calls``, a conversation too long for ``env.max_total_tokens`` (measured in characters before
anything is tokenized: :data:`workers.envs.sessions.MAX_CHARS_PER_TOKEN`), a session out of calls or context.
A session takes one call at a time (a second waits); a client that disconnects aborts its engine request and its
call leaves no trace.

Whatever a client sends is answered 400 naming the field, never 500, and counted in ``agent/bad_requests``: a body
nested deeper than :data:`MAX_JSON_DEPTH`, a reward that is not a finite number (NaN, Infinity, an integer beyond
float range), a ``wait_s`` that is not one. Chat, reward and finish on an offered session nobody claimed are
answered 409; external session ids are random (not guessable from another's).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import numbers
import re
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass

from jinja2 import TemplateError

from workers.envs.renderers import ChatTemplateRenderer, TemplateNotPrefixPreserving
from workers.envs.sessions import BadRequest, Session, SessionLimits

OVERRIDABLE = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "min_p",
               "repetition_penalty")
"""Sampling settings a request may carry; a value other than the run's is answered with the run's (counted)."""

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have (a tool's JSON schema needs far fewer)."""

_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


@dataclass
class Call:
    """What one request asks for, validated."""

    messages: list
    tools: list | None
    parse_calls: bool
    max_tokens: int | None
    stop: list[str]
    stream: bool


def parse_call(body, run_sampling: dict) -> tuple[Call, int]:
    """The request's call and how many of its sampling settings differ from the run's; :class:`BadRequest`
    naming the field otherwise."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("n", 1) != 1:
        raise BadRequest(f"n={body['n']}: one choice per call (a GRPO group is G sessions, env.agent runs the "
                         "agent G times)", "n")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise BadRequest("response_format is not supported: the reply is sampled as the run samples", "response_format")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise BadRequest(f"tool_choice={json.dumps(choice)}: only 'auto' and 'none' are supported", "tool_choice")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools must be a list of tool objects", "tools")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise BadRequest(f"max_tokens={max_tokens!r}: a positive integer", "max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 4):
        raise BadRequest("stop must be a string or a list of up to 4 non-empty strings", "stop")
    overridden = sum(key in body and body[key] is not None and body[key] != run_sampling.get(key)
                     for key in OVERRIDABLE)
    return Call(body.get("messages"), tools or None, choice != "none", max_tokens, stop,
                bool(body.get("stream", False))), overridden


def reward_of(value, spec: str) -> float:
    """An agent's reward (returned by an ``env.agent`` function, or posted by an agent outside the fleet): a finite
    number, or a dict of finite numbers (summed). :class:`BadRequest` naming the field (``reward``, ``reward.<key>``)
    otherwise: NaN, infinities and integers beyond float range are refused, never trained on."""
    named = [(f"reward.{k}", v) for k, v in value.items()] if isinstance(value, dict) else [("reward", value)]
    if not named:
        raise BadRequest(f"env.agent {spec}: the reward is an empty dict, not a number or a dict of numbers", "reward")
    total = 0.0
    for field, v in named:
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            raise BadRequest(f"env.agent {spec}: {field} is a {type(v).__name__}, not a number or a dict of numbers",
                             field)
        try:
            v = float(v)
        except OverflowError:
            raise BadRequest(f"env.agent {spec}: {field} is an integer beyond float range", field) from None
        if not math.isfinite(v):
            raise BadRequest(f"env.agent {spec}: {field} is {v}: a reward must be a finite number", field)
        total += v
    if not math.isfinite(total):
        raise BadRequest(f"env.agent {spec}: the reward's parts sum to {total}", "reward")
    return total


def parse_json(body: bytes):
    """A request body: UTF-8 JSON nested at most :data:`MAX_JSON_DEPTH` deep (checked on the text before parsing, so
    a hostile body never reaches the parser's recursion); :class:`BadRequest` naming the top-level field otherwise."""
    try:
        raw = body.decode()
    except UnicodeDecodeError:
        raise BadRequest("the request body is not UTF-8 JSON") from None
    depth, key = 0, None
    for token in _JSON_TOKENS.finditer(raw):
        t = token.group()
        if t[0] == '"':
            key = t if depth == 1 else key
        elif t in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                                 key[1:-1][:64] if key else None)
        else:
            depth -= 1
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRequest("the request body is not JSON") from None


@dataclass
class Offer:
    """A task waiting for (or claimed by) an agent outside the fleet: ``done`` resolves when it finishes."""

    task: dict
    done: asyncio.Future
    reward: object = None
    claimed: bool = False


class Endpoint:
    """One rollout actor's endpoint (see the module docstring). ``open`` a session per agent run, hand the agent
    :meth:`url` and :attr:`token`, ``close`` it after; or :meth:`offer` it to an agent outside the fleet.
    ``port``: 0 picks a free one at every :meth:`start`; a fixed port keeps the address across calls (external
    agents)."""

    def __init__(self, tokenizer, model_name: str, limits: SessionLimits, sampling: dict,
                 system_prompt: str | None = None, host: str = "127.0.0.1", port: int = 0):
        self.tokenizer, self.model_name, self.limits = tokenizer, model_name, limits
        self.sampling, self.system_prompt, self.host = sampling, system_prompt, host
        self.token = secrets.token_urlsafe(24)
        self.renderer = ChatTemplateRenderer(tokenizer, None, system_prompt)  # template checked once, not per session
        self.sessions: dict[str, tuple[Session, object, object, asyncio.Lock]] = {}
        self.offers: dict[str, Offer] = {}
        self.waiting: deque[str] = deque()
        self.counts: Counter = Counter()
        self.port = port
        self.runner = None
        self.arrived: asyncio.Event | None = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        app.router.add_post("/v1/sessions", self._claim)
        app.router.add_post("/sessions/{sid}/reward", self._reward)
        app.router.add_post("/sessions/{sid}/finish", self._finish)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.arrived = asyncio.Event()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def url(self, sid: str) -> str:
        return f"http://{self.host}:{self.port}/sessions/{sid}/v1"

    def open(self, sid: str, generate, version) -> Session:
        """A session whose calls sample with ``generate(ids, max_new_tokens, stop)`` (an awaitable
        :class:`workers.engine_loop.Completion`) and stamp ``version()`` when each request is sent."""
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already open")
        session = Session(sid, self.tokenizer, self.limits, self.system_prompt, self.renderer)
        self.sessions[sid] = (session, generate, version, asyncio.Lock())
        return session

    def close(self, sid: str) -> Session | None:
        entry = self.sessions.pop(sid, None)
        self.offers.pop(sid, None)
        return entry[0] if entry else None

    def offer(self, sid: str, task: dict, generate, version) -> tuple[Session, Offer]:
        """Open session ``sid`` for an agent outside the fleet: it waits until one claims it (``POST
        /v1/sessions``); the returned offer's ``done`` resolves when that agent finishes it."""
        session = self.open(sid, generate, version)
        self.offers[sid] = offer = Offer(task, asyncio.get_running_loop().create_future())
        self.waiting.append(sid)
        self.arrived.set()
        return session, offer

    def address(self) -> dict:
        """Where agents outside the fleet reach this endpoint: ``{"url", "token"}``."""
        return {"url": f"http://{self.host}:{self.port}", "token": self.token}

    # -- handlers ---------------------------------------------------------------------------------------------
    async def _health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok", "sessions": len(self.sessions)})

    async def _models(self, request):
        from aiohttp import web

        denied = self._denied(request)
        return denied or web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "fleetrl"}]})

    async def _chat(self, request):
        denied = self._denied(request)
        if denied:
            return denied
        sid = request.match_info["sid"]
        entry = self.sessions.get(sid)
        if entry is None:
            return _error(404, f"no open session {sid!r}", "not_found_error")
        if sid in self.offers and not self.offers[sid].claimed:
            return _unclaimed(sid)
        session, generate, version, lock = entry
        try:
            body = parse_json(await request.read())
        except BadRequest as e:
            return self._bad(session, e)
        async with lock:
            try:
                call, overridden = parse_call(body, self.sampling)
                traj, budget = session.prepare(call.messages, call.tools, _retry(request))
            except BadRequest as e:
                return self._bad(session, e)
            except (TemplateError, TemplateNotPrefixPreserving) as e:  # tools or messages the template cannot take
                return self._bad(session, BadRequest(f"the chat template cannot render them: {e}"[:300], "messages"))
            session.counts["overridden"] += overridden
            sent = version()
            try:
                turn = await generate(list(traj.episode.token_ids), min(budget, call.max_tokens or budget), call.stop)
            except BaseException:  # the client went away (the handler is cancelled) or the engine failed
                session.abandon(traj)
                raise
            message = session.record(traj, turn.token_ids, turn.logprobs, turn.text, turn.finish_reason, sent,
                                     call.parse_calls)
        message = _strip_stop(message, call.stop, turn.finish_reason)
        finish = "tool_calls" if message.get("tool_calls") else "length" if turn.finish_reason == "length" else "stop"
        reply = {"id": f"chatcmpl-{session.sid}-{session.calls}", "created": int(time.time()),
                 "model": self.model_name, "system_fingerprint": f"fleetrl-v{sent}"}
        usage = {"prompt_tokens": len(traj.episode.token_ids) - len(turn.token_ids),
                 "completion_tokens": len(turn.token_ids), "total_tokens": len(traj.episode.token_ids)}
        if call.stream:
            return await _stream(request, reply, message, finish)
        from aiohttp import web

        return web.json_response({**reply, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]})

    async def _claim(self, request):
        """The oldest waiting task, claimed: ``{"session_id", "task", "base_url", "model"}``; 204 if none waits."""
        from aiohttp import web

        denied = self._denied(request)
        if denied:
            return denied
        try:
            wait_s = _wait_s(parse_json(await request.read()) if request.can_read_body else {})
        except BadRequest as e:
            return self._bad(None, e)
        deadline = time.monotonic() + wait_s
        while True:
            while self.waiting:
                sid = self.waiting.popleft()
                offer = self.offers.get(sid)
                if offer is not None and not offer.done.done():
                    offer.claimed = True
                    return web.json_response({"session_id": sid, "task": offer.task, "base_url": self.url(sid),
                                              "model": self.model_name})
            self.arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return web.Response(status=204)
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                return web.Response(status=204)

    async def _reward(self, request, finish: bool = False):
        from aiohttp import web

        denied = self._denied(request)
        if denied:
            return denied
        sid = request.match_info["sid"]
        offer = self.offers.get(sid)
        if offer is None or offer.done.done():
            return _error(404, f"no claimed, unfinished session {sid!r} (env.agent: external)", "not_found_error")
        if not offer.claimed:
            return _unclaimed(sid)
        try:
            body = parse_json(await request.read()) if request.can_read_body else {}
            if not isinstance(body, dict) or (not finish and "reward" not in body):
                raise BadRequest("the body must be a JSON object with \"reward\"", "reward")
            if "reward" in body:
                reward_of(body["reward"], "external")
                offer.reward = body["reward"]
        except BadRequest as e:
            return self._bad(self.sessions[sid][0], e)
        if finish:
            offer.done.set_result(offer.reward)
        return web.json_response({"session_id": sid, "reward": offer.reward, "finished": finish})

    async def _finish(self, request):
        return await self._reward(request, finish=True)

    def _denied(self, request):
        given = request.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return None
        self.counts["unauthorized"] += 1
        return _error(401, "missing or wrong API key (Authorization: Bearer <token>)", "authentication_error")

    def _bad(self, session: Session | None, e: BadRequest):
        """A 400 naming the field, counted on ``session`` (None: a request of no session, counted on the endpoint
        and handed to the next finished session's sample, :meth:`AgentRunner._finish`)."""
        (session.counts if session is not None else self.counts)["bad_requests"] += 1
        return _error(400, str(e), "invalid_request_error", e.param)


def _wait_s(body) -> float:
    """A claim's ``wait_s``: a finite number of seconds, clamped to [0, 30]."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object, optionally {\"wait_s\": seconds}", "wait_s")
    wait_s = body.get("wait_s", 0)
    try:
        seconds = float(wait_s) if isinstance(wait_s, numbers.Real) and not isinstance(wait_s, bool) else math.nan
    except OverflowError:  # an integer beyond float range
        seconds = math.inf
    if not math.isfinite(seconds):
        raise BadRequest(f"wait_s={str(wait_s)[:40]}: a finite number of seconds (at most 30 are waited)", "wait_s")
    return min(max(seconds, 0.0), 30.0)


def _unclaimed(sid: str):
    return _error(409, f"session {sid!r} is offered but not claimed: claim it first (POST /v1/sessions)",
                  "conflict_error")


def _retry(request) -> bool | None:
    """Whether the client says this request retries one it sent (the ``openai`` SDKs send
    ``X-Stainless-Retry-Count``); None when it does not say."""
    count = request.headers.get("X-Stainless-Retry-Count")
    return None if count is None or not count.isdigit() else int(count) > 0


def _error(status: int, message: str, kind: str, param: str | None = None):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status)


def _strip_stop(message: dict, stop: list[str], finish_reason: str) -> dict:
    """OpenAI's replies leave out the stop string that ended them (the trained tokens keep it)."""
    content = message.get("content")
    if finish_reason != "stop" or not content or message.get("tool_calls"):
        return message
    for s in stop:
        if content.endswith(s):
            return {**message, "content": content[:-len(s)]}
    return message


async def _stream(request, reply: dict, message: dict, finish: str):
    """The finished reply as server-sent events: one delta with the whole message, one with the finish reason."""
    from aiohttp import web

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    delta = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    for choice in ({"index": 0, "delta": delta, "finish_reason": None},
                   {"index": 0, "delta": {}, "finish_reason": finish}):
        chunk = {**reply, "object": "chat.completion.chunk", "choices": [choice]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
