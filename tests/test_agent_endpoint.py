"""The agent endpoint's contract (workers/envs/endpoint.py, sessions.py, agent.py), driven by the real `openai`
client over HTTP: exact tokens per session, forks, retries, aborts, auth, 400s, streaming, agent runs that fail.
A scripted engine stands in for vLLM here (it records the context ids of every call); tests/test_agents.py runs
agent episodes on the real stack."""

import asyncio
import json
import math
import re

import openai
import pytest

from tests.test_envs import smollm2_tokenizer
from workers.engine_loop import Completion
from workers.envs.agent import AgentRunner, load_agent
from workers.envs.endpoint import Endpoint
from workers.envs.sessions import SessionLimits

CALC = {"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}}}}}


class Engine:
    """Writes the scripted turns (token ids) in order; keeps the context ids each call was sent."""

    def __init__(self, tok, turns: list[list[int]], delay_s: float = 0.0):
        self.tok, self.turns, self.delay_s = tok, list(turns), delay_s
        self.contexts: list[list[int]] = []
        self.cancelled = 0

    async def generate(self, ids, max_new_tokens, stop=None):
        self.contexts.append(list(ids))
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        out = self.turns.pop(0)[:max_new_tokens]
        return Completion(out, [-0.25] * len(out), self.tok.decode(out, skip_special_tokens=True),
                          "stop" if out and out[-1] == self.tok.eos_token_id else "length")


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def call_turn(tok, expression: str) -> list[int]:
    return ids(tok, f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>') \
        + [tok.eos_token_id]


async def serve(tok, engine, fn, max_turns=4, max_total_tokens=1024, max_new_tokens=64):
    """Run ``fn(endpoint, session)`` against a started endpoint with one open session ``s``."""
    ep = Endpoint(tok, "policy", SessionLimits(max_turns, max_total_tokens, max_new_tokens),
                  {"temperature": 1.0, "top_p": 1.0})
    await ep.start()
    try:
        session = ep.open("s", engine.generate, lambda: 7)
        return await fn(ep, session)
    finally:
        await ep.stop()


def client_for(ep, **kw):
    return openai.AsyncOpenAI(base_url=ep.url("s"), api_key=ep.token, **kw)


def test_a_three_turn_session_trains_exactly_the_sampled_ids_not_a_re_tokenization():
    """Two tool calls and an answer, the first turn spelled in ids the tokenizer would not produce: each call's
    prompt is the previous call's context + the sampled ids + only the new messages' ids."""
    tok = smollm2_tokenizer()
    odd = ids(tok, " Let me") + ids(tok, " comp") + ids(tok, "ute.")
    assert ids(tok, tok.decode(odd)) != odd  # decode -> encode would merge them
    turns = [odd + call_turn(tok, "347*58")[:-1] + [tok.eos_token_id], call_turn(tok, "20126+1"),
             ids(tok, "It is 20127.") + [tok.eos_token_id]]
    engine = Engine(tok, turns)

    async def agent(ep, session):
        client = client_for(ep)
        messages = [{"role": "user", "content": "What is 347 * 58 + 1?"}]
        for result in ("20126", "20127", None):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if result is not None:
                assert reply.choices[0].finish_reason == "tool_calls"
                assert json.loads(message.tool_calls[0].function.arguments)["expression"] in ("347*58", "20126+1")
                messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result})
        await client.close()
        return messages, session.episode()

    messages, episode = asyncio.run(serve(tok, engine, agent))
    assert messages[-1]["content"] == "It is 20127."
    sampled = [t for t, m in zip(episode.token_ids, episode.mask) if m]
    assert sampled == turns[0] + turns[1] + turns[2]  # the trained ids are the engine's, verbatim
    assert episode.token_ids[:len(engine.contexts[2])] == engine.contexts[2]  # calls extend one context
    assert engine.contexts[1][:len(engine.contexts[0]) + len(turns[0])] == engine.contexts[0] + turns[0]
    assert episode.tool_calls == 2 and episode.turn_ends[-1] == len(episode.token_ids) - 1
    retokenized = ids(tok, tok.apply_chat_template(episode.messages, tokenize=False))
    assert retokenized[:len(episode.token_ids)] != episode.token_ids  # what re-rendering the history would train
    assert tok.decode(episode.token_ids) + "\n" == tok.apply_chat_template(episode.messages, tokenize=False)


def test_a_client_that_edits_an_earlier_reply_forks_and_the_sample_is_the_new_trajectory():
    tok = smollm2_tokenizer()
    engine = Engine(tok, [call_turn(tok, "2+3"), ids(tok, "5") + [tok.eos_token_id],
                          ids(tok, "Five.") + [tok.eos_token_id]])

    async def agent(ep, session):
        client = client_for(ep)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
        messages += [reply.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": reply.tool_calls[0].id,
                                                           "content": "5"}]
        second = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
        # the same turns, but the first reply rewritten (as a client that strips tool calls or reasoning does)
        edited = [messages[0], {"role": "assistant", "content": "I used a tool."}, messages[2],
                  second.model_dump(exclude_none=True), {"role": "user", "content": "In words?"}]
        await client.chat.completions.create(model="policy", messages=edited)  # not what was sampled: a fork
        await client.close()
        return session

    session = asyncio.run(serve(tok, engine, agent))
    episode = session.episode()
    assert session.counts["forks"] == 1 and len(session.trajectories) == 2
    assert episode.info["agent/forks"] == 1
    sampled = [t for t, m in zip(episode.token_ids, episode.mask) if m]
    assert sampled == ids(tok, "Five.") + [tok.eos_token_id]  # only the new branch's turn is trained
    assert "I used a tool." in tok.decode(episode.token_ids[:episode.prompt_len])  # the client's history, as prompt


def test_a_retried_call_replaces_its_turn_and_a_disconnected_one_leaves_no_trace():
    """The openai client's retry after a lost reply is the same call again (one sample, not two); a client that
    gives up mid-call aborts the engine request and the session is as before it."""
    tok = smollm2_tokenizer()
    engine = Engine(tok, [ids(tok, "A") + [tok.eos_token_id], ids(tok, "B") + [tok.eos_token_id]])
    messages = [{"role": "user", "content": "Say a letter."}]

    async def agent(ep, session):
        client = client_for(ep)
        await client.chat.completions.create(model="policy", messages=messages)
        await client.chat.completions.create(model="policy", messages=messages,  # the reply was lost: a retry
                                             extra_headers={"X-Stainless-Retry-Count": "1"})
        engine.delay_s = 30.0
        impatient = client_for(ep, timeout=0.5, max_retries=0)
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(model="policy", messages=[
                *messages, {"role": "assistant", "content": "B"}, {"role": "user", "content": "Another."}])
        for _ in range(50):  # the server notices the disconnect
            if session.counts["aborted"]:
                break
            await asyncio.sleep(0.05)
        await client.close()
        await impatient.close()
        return session

    session = asyncio.run(serve(tok, engine, agent))
    episode = session.episode()
    assert session.counts["retries"] == 1 and session.counts["aborted"] == 1 and engine.cancelled == 1
    assert len(episode.turn_ends) == 1 and session.calls == 2
    assert [t for t, m in zip(episode.token_ids, episode.mask) if m] == ids(tok, "B") + [tok.eos_token_id]
    assert len(episode.token_ids) == episode.turn_ends[-1] + 1  # the aborted call's messages are not appended


def test_the_same_call_sent_again_on_purpose_branches_from_the_same_ids():
    """The openai client marks a first attempt with X-Stainless-Retry-Count: 0: the same messages again are a new
    sample of the same state (a branch, counted as a fork), not a retry; its prompt is the exact same ids."""
    tok = smollm2_tokenizer()
    engine = Engine(tok, [ids(tok, "A") + [tok.eos_token_id], ids(tok, "B") + [tok.eos_token_id],
                          ids(tok, "C") + [tok.eos_token_id]])
    messages = [{"role": "user", "content": "Say a letter."}]

    async def agent(ep, session):
        client = client_for(ep)
        first = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
        await client.chat.completions.create(model="policy", messages=[
            *messages, first.model_dump(exclude_none=True), {"role": "user", "content": "Another."}])
        await client.chat.completions.create(model="policy", messages=[
            *messages, first.model_dump(exclude_none=True), {"role": "user", "content": "Another."}])
        await client.close()
        return session

    session = asyncio.run(serve(tok, engine, agent))
    episode = session.episode()
    assert session.counts["forks"] == 1 and session.counts["retries"] == 0 and len(session.trajectories) == 2
    assert engine.contexts[2] == engine.contexts[1]  # the branch starts from the very same ids
    assert [t for t, m in zip(episode.token_ids, episode.mask) if m] == ids(tok, "A") + [2] + ids(tok, "C") + [2]


def test_auth_bad_requests_and_streaming():
    tok = smollm2_tokenizer()
    engine = Engine(tok, [call_turn(tok, "6*7"), ids(tok, "Hi") + [tok.eos_token_id]])

    async def agent(ep, session):
        messages = [{"role": "user", "content": "Hello"}]
        stranger = openai.AsyncOpenAI(base_url=ep.url("s"), api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await stranger.chat.completions.create(model="policy", messages=messages)
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()
        client = client_for(ep, max_retries=0)
        assert [m.id for m in (await client.models.list()).data] == ["policy"]
        refusals = {}
        for key, extra in (("n", {"n": 2}), ("response_format", {"response_format": {"type": "json_object"}}),
                           ("tool_choice", {"tool_choice": "required"}), ("max_tokens", {"max_tokens": 0})):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="policy", messages=messages, **extra)
            refusals[key] = err.value.body["param"]
        with pytest.raises(openai.BadRequestError, match="role"):
            await client.chat.completions.create(model="policy", messages=[{"content": "no role"}])
        assert refusals == {k: k for k in refusals} and session.calls == 0 and not engine.contexts
        chunks = [c async for c in await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALC], stream=True, temperature=0.2)]
        call = chunks[0].choices[0].delta.tool_calls[0]
        assert call.function.name == "calculator" and chunks[-1].choices[0].finish_reason == "tool_calls"
        none = await client.chat.completions.create(model="policy", messages=[
            *messages, {"role": "assistant", "tool_calls": [c.model_dump() for c in chunks[0].choices[0].delta.
                                                              tool_calls]},
            {"role": "tool", "tool_call_id": call.id, "content": "42"}], tool_choice="none", tools=[CALC])
        assert none.choices[0].message.content == "Hi"
        await client.close()
        await stranger.close()
        return session

    session = asyncio.run(serve(tok, engine, agent))
    assert session.counts["bad_requests"] == 5 and session.counts["overridden"] == 1
    assert session.counts["forks"] == 0  # the streamed tool call, echoed back, continues the trajectory


def test_max_tokens_is_clamped_to_the_context_and_a_full_session_is_refused():
    tok = smollm2_tokenizer()
    engine = Engine(tok, [ids(tok, "one two three four five six seven eight"), ids(tok, "x")])

    async def agent(ep, session):
        client = client_for(ep, max_retries=0)
        messages = [{"role": "user", "content": "Count."}]
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=1000)
        assert reply.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="max_total_tokens"):
            await client.chat.completions.create(model="policy", messages=[
                *messages, reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "More."}])
        await client.close()
        return session

    budget = len(ids(tok, tok.apply_chat_template([{"role": "user", "content": "Count."}], tokenize=False,
                                                  add_generation_prompt=True))) + 4
    session = asyncio.run(serve(tok, engine, agent, max_total_tokens=budget, max_new_tokens=6))
    assert len(session.episode().turn_ends) == 1 and len(session.episode().token_ids) == budget


async def solve(client, task):
    """A user's agent: ask, call the calculator it is told to, answer; the reward is whether the answer is right."""
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(3):
        message = (await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
                   ).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(message.content.strip().endswith(task["answer"]))
        for c in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": "5"})
    return 0.0


async def raises(client, task):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the agent's own bug")


async def sleeps(client, task):
    await asyncio.sleep(60)


async def returns_text(client, task):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return "good"


async def returns_nan(client, task):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return {"right": 1.0, "style": float("nan")}


def run_agent(spec: str, turns, timeout_s: float = 30.0):
    tok = smollm2_tokenizer()
    engine = Engine(tok, turns)
    env = {"agent": spec, "episode_timeout_s": timeout_s, "max_turns": 4, "max_total_tokens": 512}
    runner = AgentRunner(env, tok, 64, {"temperature": 1.0, "top_p": 1.0}, "rollout-0")

    async def main():
        async with runner.serving():
            start = runner.episode("What is 2 + 3?", {"answer": "5"}, lambda: 3, lambda turn: turn)
            return await start(lambda ids_, n, seed, stop: engine.generate(ids_, n, stop))

    return asyncio.run(main())


def test_an_agent_function_is_the_environment_and_its_failures_end_only_its_run():
    tok = smollm2_tokenizer()
    ep = run_agent("tests.test_agent_endpoint:solve", [call_turn(tok, "2+3"), ids(tok, "It is 5") + [2]])
    assert ep.termination == "done" and ep.turn_rewards == [0.0, 1.0] and ep.tool_calls == 1
    assert ep.info["agent/calls"] == 2
    err = run_agent("tests.test_agent_endpoint:raises", [ids(tok, "hi") + [2]])
    assert err.termination == "env_error" and "the agent's own bug" in err.info["error"] and err.turn_rewards == [0.0]
    late = run_agent("tests.test_agent_endpoint:sleeps", [], timeout_s=0.3)
    assert late.termination == "timeout" and late.prompt_len == len(late.token_ids) > 0  # the prompt, no turn
    text = run_agent("tests.test_agent_endpoint:returns_text", [ids(tok, "hi") + [2]])
    assert text.termination == "env_error" and "a number or a dict of numbers" in text.info["error"]
    nan = run_agent("tests.test_agent_endpoint:returns_nan", [ids(tok, "hi") + [2]])  # errored: its group dropped
    assert nan.termination == "env_error" and "reward.style is nan" in nan.info["error"], nan.info
    assert all(math.isfinite(r) for r in nan.turn_rewards)


def not_async(client, task):
    return 1.0


async def one_arg(client):
    return 1.0


@pytest.mark.parametrize("spec, problem", [
    ("tests.test_agent_endpoint:not_async", "is not an async function"),
    ("tests.test_agent_endpoint:one_arg", "must take two arguments"),
    ("tests.test_agent_endpoint:missing", "has no 'missing'"),
    ("no_such_module:fn", "module 'no_such_module' not found"),
    ("solve", "package.module:function"),
])
def test_a_bad_agent_is_refused_at_load(spec, problem):
    from orchestrator.config import ConfigError, load_config

    with pytest.raises(ValueError, match=problem):
        load_agent(spec)
    with pytest.raises(ConfigError, match=f"env.agent.*{problem}"):
        load_config(None, [f"env.agent={spec}"])


def test_an_agent_on_a_model_without_a_chat_template_is_refused_before_anything_starts(tmp_path):
    """The embedded model has no chat template: `fleetrl train env.agent=...` exits 2 naming the key, before Ray."""
    from tests.conftest import cli

    proc = cli("train", "reward.functions=[]", "env.agent=examples.math_agent:solve", f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "env.agent=examples.math_agent:solve" in proc.stderr, proc.stderr[-2000:]
    assert "no chat template" in proc.stderr and not (tmp_path / "run").exists()


def test_an_openai_agents_sdk_agent_runs_against_the_endpoint_without_forks():
    """examples/sdk_agent.py (the OpenAI Agents SDK runs the tool loop): its calls continue one trajectory."""
    pytest.importorskip("agents")
    tok = smollm2_tokenizer()
    ep = run_agent("examples.sdk_agent:solve", [call_turn(tok, "2+3"), ids(tok, "5") + [2]])
    assert ep.termination == "done" and ep.info.get("agent/forks", 0) == 0, ep.info
    assert ep.turn_rewards == [0.0, 1.0] and ep.tool_calls == 1 and ep.messages[3]["content"] == "5"


def test_a_langgraph_agent_runs_against_the_endpoint_without_forks():
    """examples/langgraph_agent.py (LangGraph's agent/tools loop, LangChain's ChatOpenAI writing the requests and
    echoing the history back): its calls continue one trajectory, the tool's result reaches the model."""
    pytest.importorskip("langgraph")
    tok = smollm2_tokenizer()
    ep = run_agent("examples.langgraph_agent:solve", [call_turn(tok, "2+3"), ids(tok, "5") + [2]])
    assert ep.termination == "done" and ep.info.get("agent/forks", 0) == 0, ep.info
    assert ep.turn_rewards == [0.0, 1.0] and ep.tool_calls == 1 and ep.messages[3]["content"] == "5"


def test_an_agent_outside_the_fleet_claims_calls_rewards_and_finishes_its_sessions():
    """`env.agent: external`: three runs offered; an outside agent (plain HTTP + the openai client) claims two and
    finishes them (one with a reward posted first, one with a bad reward refused), the third is never claimed and
    times out. Control calls need the token; a finished session cannot be finished again."""
    import httpx

    tok = smollm2_tokenizer()
    engine = Engine(tok, [ids(tok, "It is 5") + [2], ids(tok, "It is 6") + [2]])
    env = {"agent": "external", "episode_timeout_s": 3.0, "max_turns": 4, "max_total_tokens": 512}
    runner = AgentRunner(env, tok, 64, {"temperature": 1.0, "top_p": 1.0}, "rollout-0")
    port = runner.endpoint.port
    assert port > 0  # fixed before serving: the address agents outside read stays the same across calls

    async def outside(http, url, auth):
        assert (await http.post(f"{url}/v1/sessions")).status_code == 401
        first = (await http.post(f"{url}/v1/sessions", headers=auth, json={"wait_s": 5})).json()
        second = (await http.post(f"{url}/v1/sessions", headers=auth)).json()
        assert first["task"] == {"answer": "5", "prompt": "What is 2 + 3?"} and first["session_id"] != second[
            "session_id"]
        assert all(re.fullmatch(r"rollout-0-[\w-]{16}", c["session_id"]) for c in (first, second))  # random ids
        for claimed, expect in ((first, "It is 5"), (second, "It is 6")):
            client = openai.AsyncOpenAI(base_url=claimed["base_url"], api_key=runner.endpoint.token)
            reply = await client.chat.completions.create(model=claimed["model"], messages=[
                {"role": "user", "content": claimed["task"]["prompt"]}])
            assert reply.choices[0].message.content == expect
            await client.close()
        sid = first["session_id"]
        bad = await http.post(f"{url}/sessions/{sid}/reward", headers=auth, json={"reward": "good"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"
        assert (await http.post(f"{url}/sessions/{sid}/reward", headers=auth, json={"reward": {"a": 0.5, "b": 0.25}})
                ).status_code == 200
        assert (await http.post(f"{url}/sessions/{sid}/finish", headers=auth)).json()["finished"]
        assert (await http.post(f"{url}/sessions/{sid}/finish", headers=auth)).status_code == 404
        assert (await http.post(f"{url}/sessions/{second['session_id']}/finish", headers=auth,
                                json={"reward": 1.0})).status_code == 200

    async def main():
        async with runner.serving():
            url, auth = runner.endpoint.address()["url"], {"Authorization": f"Bearer {runner.endpoint.token}"}
            runs = [runner.episode("What is 2 + 3?", {"answer": "5"}, lambda: 3, lambda turn: turn)
                    for _ in range(3)]
            gen = lambda ids_, n, seed, stop: engine.generate(ids_, n, stop)  # noqa: E731
            async with httpx.AsyncClient(trust_env=False) as http:
                assert (await http.post(f"{url}/v1/sessions", headers=auth)).status_code == 204  # none offered yet
                eps = await asyncio.gather(*(run(gen) for run in runs), outside(http, url, auth))
        return eps[:3]

    first, second, third = asyncio.run(main())
    assert (first.termination, first.turn_rewards) == ("done", [0.75])
    assert (second.termination, second.turn_rewards) == ("done", [1.0])
    assert third.termination == "timeout" and third.info.get("agent/unclaimed") == 1
    assert third.prompt_len == len(third.token_ids) > 0  # the task's prompt, no turn


NESTED = "[" * 10_000 + "]" * 10_000
CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
HOSTILE = [  # (what a client sends, path (c: a claimed session, u: an offered one nobody claimed), body, status, param)
    ("NaN reward with finish", "/sessions/c/finish", '{"reward": NaN}', 400, "reward"),
    ("Infinity reward", "/sessions/c/reward", '{"reward": Infinity}', 400, "reward"),
    ("1e400 reward (inf once parsed)", "/sessions/c/reward", '{"reward": 1e400}', 400, "reward"),
    ("NaN in a reward dict", "/sessions/c/reward", '{"reward": {"a": 0.5, "b": NaN}}', 400, "reward.b"),
    ("4000-digit integer reward", "/sessions/c/finish", '{"reward": ' + "9" * 4000 + "}", 400, "reward"),
    ("parts summing past float range", "/sessions/c/reward", '{"reward": {"a": 1e308, "b": 1e308}}', 400, "reward"),
    ("10000-level nested chat", "/sessions/c/v1/chat/completions", '{"messages": ' + NESTED + "}", 400, "messages"),
    ("10000-level nested claim", "/v1/sessions", '{"wait_s": ' + NESTED + "}", 400, "wait_s"),
    ("10000-level nested reward", "/sessions/c/reward", '{"reward": ' + NESTED + "}", 400, "reward"),
    ('tool_calls: "x"', "/sessions/c/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": "x"}]}), 400, "messages"),
    ("a tool call without a function", "/sessions/c/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "1"}]}]}), 400, "messages"),
    ("a list as tool_call_id", "/sessions/c/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": [1], "content": "5"}]}), 400, "messages"),
    ("wait_s NaN", "/v1/sessions", '{"wait_s": NaN}', 400, "wait_s"),
    ("wait_s Infinity", "/v1/sessions", '{"wait_s": Infinity}', 400, "wait_s"),
    ('wait_s "5"', "/v1/sessions", '{"wait_s": "5"}', 400, "wait_s"),
    ("a body that is not UTF-8", "/sessions/c/reward", b'{"reward": "\xff"}', 400, None),
    ("1 MB message, just under the body limit", "/sessions/c/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": "word " * 200_000}]}), 400, "messages"),
    ("chat to an unclaimed session", "/sessions/u/v1/chat/completions", CHAT, 409, None),
    ("reward to an unclaimed session", "/sessions/u/reward", '{"reward": 1.0}', 409, None),
    ("finish of an unclaimed session", "/sessions/u/finish", '{"reward": 1.0}', 409, None),
    ("a valid reward (control)", "/sessions/c/reward", '{"reward": {"a": 0.5, "b": 0.25}}', 200, None),
    ("a valid chat (control)", "/sessions/c/v1/chat/completions", CHAT, 200, None),
]


def test_what_a_client_sends_is_answered_400_naming_the_field_or_409_never_500():
    """The hostile-request table, row by row on the scripted engine: each hostile request gets its status and names its
    field, each 400 is counted in agent/bad_requests (the session's, or the endpoint's for a claim), a refused
    reward never replaces the last good one, an unclaimed session takes nothing, and the 1 MB message is refused
    before it is tokenized (no engine call, no time on the loop)."""
    import time

    import httpx

    tok = smollm2_tokenizer()
    engine = Engine(tok, [ids(tok, "Hi") + [2]])

    async def main():
        ep = Endpoint(tok, "policy", SessionLimits(4, 1024, 64), {"temperature": 1.0, "top_p": 1.0})
        await ep.start()
        try:
            _, claimed = ep.offer("c", {"prompt": "hi"}, engine.generate, lambda: 7)
            auth = {"Authorization": f"Bearer {ep.token}", "Content-Type": "application/json"}
            async with httpx.AsyncClient(base_url=ep.address()["url"], headers=auth, trust_env=False) as http:
                assert (await http.post("/v1/sessions")).json()["session_id"] == "c"
                unclaimed_session, unclaimed = ep.offer("u", {"prompt": "hi"}, engine.generate, lambda: 7)
                seen = []
                for what, path, body, _, _ in HOSTILE:
                    before = ep.counts["bad_requests"] + sum(s.counts["bad_requests"] for s, *_ in
                                                             ep.sessions.values())
                    start = time.perf_counter()
                    reply = await http.post(path, content=body if isinstance(body, bytes) else body.encode())
                    took = time.perf_counter() - start
                    after = ep.counts["bad_requests"] + sum(s.counts["bad_requests"] for s, *_ in
                                                            ep.sessions.values())
                    param = reply.json()["error"]["param"] if reply.status_code >= 400 else None
                    seen.append((what, reply.status_code, param, after - before, took))
                return seen, claimed, unclaimed, unclaimed_session, ep.counts["bad_requests"]
        finally:
            await ep.stop()

    seen, claimed, unclaimed, unclaimed_session, claim_bad = asyncio.run(main())
    for (what, status, param, counted, _), (_, _, _, want, want_param) in zip(seen, HOSTILE):
        assert (status, param, counted) == (want, want_param, int(want == 400)), (what, status, param, counted)
    assert claim_bad == 4  # the claims' 400s, handed to the next finished sample (AgentRunner._finish)
    assert claimed.reward == {"a": 0.5, "b": 0.25} and not claimed.done.done()  # the NaN finish finished nothing
    assert unclaimed.reward is None and unclaimed_session.calls == 0 and not unclaimed.done.done()
    assert len(engine.contexts) == 1  # only the control chat reached the engine
    big = next(row for row in seen if row[0].startswith("1 MB"))
    assert big[4] < 0.5, f"the 1 MB message took {big[4]:.2f} s to refuse"  # tokenizing it takes about 1 s


def test_the_endpoints_file_is_readable_by_its_owner_only_and_gone_when_the_run_ends(tmp_path, monkeypatch):
    """`<run.dir>/agent_endpoints.json` holds the endpoints' tokens: written 0600 (an older 0644 one replaced), and
    removed when the run ends, failed or not (an outside agent then knows the run is gone, not between calls)."""
    import os
    import stat
    from types import SimpleNamespace

    from orchestrator.config import load_config
    from orchestrator.loops.policy import PolicyLoop
    from orchestrator.rl import pools
    from orchestrator.rl.driver import Run

    class Worker:  # an engine's agent_address, answered in place (ray.get passes it through)
        agent_address = SimpleNamespace(remote=lambda env, budget: {"worker": "rollout-0", "url": "http://x:1",
                                                                     "token": "secret"})

    path = tmp_path / pools.AGENT_ENDPOINTS
    path.write_text("{}")
    path.chmod(0o644)
    cfg = load_config(None, [f"run.dir={tmp_path}"])
    monkeypatch.setattr(pools.ray, "get", lambda refs: refs)
    pools.RolloutPool.publish_agent_endpoints(SimpleNamespace(cfg=cfg, workers=[Worker()]), {})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and json.loads(path.read_text())["endpoints"][0]["token"]
    run = Run(cfg, PolicyLoop)
    monkeypatch.setattr(run, "_steps", lambda fleet: (_ for _ in ()).throw(RuntimeError("the run failed")))
    with pytest.raises(RuntimeError, match="the run failed"):
        run.run()
    assert not path.exists()
