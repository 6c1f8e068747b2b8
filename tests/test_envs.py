"""Multi-turn episode core (workers/envs): exact tokens, masks, limits, tools, renderers. A scripted policy stands
in for the engine here (the end-to-end tests in tests/test_agents.py run vLLM)."""

import asyncio
import copy
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.models.embedded_model import TOOL_CHARS, build_tokenizer
from workers.envs.api import Environment, StepResult
from workers.envs.episode import EpisodeLimits, run_episode
from workers.envs.renderers import ChatTemplateRenderer, TemplateNotPrefixPreserving, TextRenderer
from workers.envs.tool_env import ToolEnv
from workers.envs.tools import CALCULATOR, Tool, calculate, run_tool

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".fleetrl/models/smollm2-135m-instruct"


@dataclass
class Turn:
    token_ids: list
    logprobs: list
    text: str
    finish_reason: str = "stop"


def scripted(tokenizer, texts: list[str], finish: str = "stop"):
    """A policy that writes ``texts`` turn by turn (ids from the tokenizer, logprob -0.5 each)."""
    turns = iter(texts)

    async def generate(context_ids, max_new_tokens):
        text = next(turns)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
        return Turn(ids, [-0.5] * len(ids), tokenizer.decode(ids), finish if len(ids) == max_new_tokens else "stop")

    return generate


def play(env, renderer, generate, **limits):
    return asyncio.run(run_episode(env, renderer, {"prompt": "347*58="}, 0, EpisodeLimits(**limits), generate))


class Counting(ToolEnv):
    closed = 0

    def close(self):
        Counting.closed += 1


# ---- the calculator -----------------------------------------------------------------------------------------------
def test_calculator_is_exact_and_refuses_everything_but_arithmetic():
    assert calculate("347*58") == "20126" and calculate("(2+3)**2 - 7 // 2") == "22" and calculate("7/2") == "3.5"
    for bad in ["__import__('os').system('id')", "x + 1", "(1).real", "9**999", "open('/etc/passwd')", "[1]*3",
                "2**100*2**100**2"]:
        with pytest.raises(ValueError):
            calculate(bad)


def test_tool_errors_and_timeouts_become_observations_not_exceptions():
    def slow(expression):
        time.sleep(2)

    def boom(expression):
        raise RuntimeError("kaput")

    r = asyncio.run(run_tool(Tool("slow", slow, "", timeout_s=0.2), {"expression": "1"}))
    assert r.error == "slow timed out after 0.2s" and r.seconds < 1.0
    r = asyncio.run(run_tool(Tool("boom", boom, ""), {"expression": "1"}))
    assert "RuntimeError: kaput" in r.error
    r = asyncio.run(run_tool(CALCULATOR, {"bad_argument": "1"}))
    assert r.error == "calculator: bad arguments: 'expression' is a required property"
    r = asyncio.run(run_tool(Tool("long", lambda expression: "9" * 50, "", max_output_chars=10), {"expression": ""}))
    assert r.output.startswith("9" * 10) and "[cut at 10 chars]" in r.output


def test_python_tool_runs_in_the_sandbox_and_reaches_nothing():
    from rewards.sandbox import SandboxUnavailable, check_sandbox
    from workers.envs.tools import run_python

    try:
        check_sandbox()
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    assert run_python("print(2 + 3)") == "5\n"
    net = run_python("import socket\nfor host in ['1.1.1.1', '127.0.0.1']:\n    s = socket.socket()\n"
                     "    s.settimeout(1)\n    try:\n        s.connect((host, 53)); print('CONNECTED')\n"
                     "    except OSError: print('no')\n")
    assert net == "no\nno\n"
    files = run_python(f"import os\nprint(os.path.exists('{ROOT}/README.md'), os.path.exists('{ROOT}'))\n"
                       "try:\n    print(open('/etc/shadow').read()[:10])\nexcept OSError as e:\n"
                       "    print(type(e).__name__)\n")
    assert files == "False False\nPermissionError\n"  # no repository; system dirs read-only, root's files closed


# ---- episodes with the text renderer (the embedded calculator model's vocabulary) --------------------------------
TOK = build_tokenizer(TOOL_CHARS)


def test_tool_episode_tokens_and_mask_are_exact():
    Counting.closed = 0
    ep = play(Counting([CALCULATOR]), TextRenderer(TOK), scripted(TOK, ["[347*58]", "20126"]), max_total_tokens=64)
    text = TOK.decode(ep.token_ids)
    assert text == "347*58=[347*58]{20126}20126" and ep.termination == "done" and Counting.closed == 1
    assert len(ep.token_ids) == len(ep.mask) == len(ep.logprobs)
    sampled = "".join(ch for ch, m in zip(text, ep.mask) if m)  # char tokenizer: one token per character
    assert sampled == "[347*58]20126" and ep.prompt_len == 7
    assert [lp for lp, m in zip(ep.logprobs, ep.mask) if not m] == [0.0] * (len(ep.mask) - sum(ep.mask))
    assert ep.turn_ends == [14, 26] and ep.tool_calls == 1 and ep.tool_errors == 0 and ep.observation_tokens == 7
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize("policy,limits,reason", [
    (["20126"], {}, "done"),
    (["[1+1]", "[2+2]", "[3+3]"], {"max_turns": 2, "max_tool_calls": 5}, "max_turns"),
    (["[1+1]", "[2+2][3+3]"], {"max_tool_calls": 2}, "max_tool_calls"),
    (["[99999*99999]"], {"max_total_tokens": 24}, "max_total_tokens"),  # the observation would overflow
    (["[1+1]", "2222222222"], {"max_total_tokens": 20}, "max_total_tokens"),  # a turn cut by the budget
    (["2222222222"], {"max_new_tokens": 4}, "truncated"),
])
def test_every_limit_ends_the_episode_with_its_reason(policy, limits, reason):
    Counting.closed = 0
    ep = play(Counting([CALCULATOR]), TextRenderer(TOK), scripted(TOK, policy, finish="length"),
              **{"max_total_tokens": 64, **limits})
    assert ep.termination == reason and Counting.closed == 1
    assert len(ep.token_ids) <= ep.prompt_len + 64 and len(ep.token_ids) <= limits.get("max_total_tokens", 64)
    assert len(ep.token_ids) == len(ep.mask) == len(ep.logprobs)


def test_environment_errors_and_timeouts_end_only_their_episode():
    class Broken(Counting):
        def step(self, action):
            raise KeyError("bad state")

    class Stuck(Counting):
        async def step(self, action):
            await asyncio.sleep(10)

    for env, reason in ((Broken([CALCULATOR]), "env_error"), (Stuck([CALCULATOR]), "timeout")):
        Counting.closed = 0
        ep = play(env, TextRenderer(TOK), scripted(TOK, ["[1+1]"]), episode_timeout_s=0.5)
        assert ep.termination == reason and ep.errored and Counting.closed == 1


def test_the_episode_timeout_counts_the_environments_time_not_the_engines():
    """Turns that wait 0.4 s each for a busy engine (3 turns: 1.2 s) fit a 0.5 s episode limit: it bounds the
    environment, whose three steps of 0.2 s each (0.6 s) do not fit."""
    def slow_engine(texts):
        inner = scripted(TOK, texts)

        async def generate(ids, max_new_tokens):
            await asyncio.sleep(0.4)
            return await inner(ids, max_new_tokens)

        return generate

    class Slow(Counting):
        async def step(self, action):
            await asyncio.sleep(0.2)
            return await super().step(action)

    ep = play(Counting([CALCULATOR]), TextRenderer(TOK), slow_engine(["[1+1]", "[2+2]", "6"]), episode_timeout_s=0.5)
    assert ep.termination == "done" and ep.tool_calls == 2, ep.termination
    ep = play(Slow([CALCULATOR]), TextRenderer(TOK), scripted(TOK, ["[1+1]", "[2+2]", "6"]), episode_timeout_s=0.5)
    assert ep.termination == "timeout" and ep.tool_calls == 2, (ep.termination, ep.tool_calls)


def test_a_tool_past_its_timeout_does_not_stall_the_other_episodes():
    """8 episodes at once; one's tool sleeps 3 s under a 0.3 s timeout. The other 7 finish at once; the slow one
    gets an error observation after ~0.3 s and finishes too."""
    def slow_or_fast(expression):
        if expression == "0+0":
            time.sleep(3)
        return calculate(expression)

    tool = Tool("calculator", slow_or_fast, "", timeout_s=0.3)
    finished: dict[int, float] = {}

    async def main():
        t0 = time.perf_counter()

        async def one(i):
            ep = await run_episode(ToolEnv([tool]), TextRenderer(TOK), {"prompt": "1*1="}, i, EpisodeLimits(),
                                   scripted(TOK, [f"[{i}+{i}]", "1"]))
            finished[i] = time.perf_counter() - t0
            return ep

        return await asyncio.gather(*(one(i) for i in range(8)))

    eps = asyncio.run(main())
    assert all(ep.termination == "done" for ep in eps)
    assert eps[0].tool_errors == 1 and eps[0].messages[2]["content"] == "calculator timed out after 0.3s"
    assert max(finished[i] for i in range(1, 8)) < 0.25 and 0.3 <= finished[0] < 1.5, finished
    assert TOK.decode(eps[0].token_ids) == "1*1=[0+0]{}1"  # the text renderer writes an error as {}


def test_text_renderer_leak_canary():
    r = TextRenderer(TOK)
    assert r.leaked("[1+1]{2}") and not r.leaked("[1+1]")


# ---- episodes with a real chat template (SmolLM2's ChatML) ----------------------------------------------------------
@functools.cache
def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    if (SMOLLM2 / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(SMOLLM2)
    from orchestrator.models.model_import import packaged_gguf  # not converted yet: the same tokenizer, from the GGUF

    gguf = packaged_gguf("smollm2-135m-instruct")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def smollm2_tokenizer():
    """SmolLM2's BPE tokenizer and ChatML template (a fresh copy: a test may change its template)."""
    return copy.deepcopy(_smollm2_tokenizer())


def test_chat_episode_keeps_sampled_ids_verbatim_when_decode_encode_is_not_the_identity():
    """The sampled ids spell ' hello' as ' hel' + 'lo' (not how the BPE tokenizer encodes it): the episode keeps
    them; a decode -> encode of the history would have merged them."""
    tok = smollm2_tokenizer()
    odd = tok(" hel", add_special_tokens=False)["input_ids"] + tok("lo", add_special_tokens=False)["input_ids"]
    assert tok(tok.decode(odd), add_special_tokens=False)["input_ids"] != odd  # decode -> encode changes them
    call = tok('<tool_call>{"name": "calculator", "arguments": {"expression": "347*58"}}</tool_call>',
               add_special_tokens=False)["input_ids"]
    turns = iter([odd + call + [tok.eos_token_id], tok("20126", add_special_tokens=False)["input_ids"]
                  + [tok.eos_token_id]])

    async def generate(context_ids, max_new_tokens):
        ids = next(turns)
        return Turn(ids, [-0.1] * len(ids), tok.decode(ids, skip_special_tokens=True))

    renderer = ChatTemplateRenderer(tok, [CALCULATOR])
    ep = asyncio.run(run_episode(ToolEnv([CALCULATOR]), renderer, {"prompt": "What is 347 * 58?"}, 0,
                                 EpisodeLimits(max_total_tokens=512), generate))
    assert ep.termination == "done" and ep.tool_calls == 1 and ep.messages[2]["content"] == "20126"
    first = ep.token_ids[ep.prompt_len: ep.prompt_len + len(odd)]
    assert first == odd  # verbatim
    sampled = [t for t, m in zip(ep.token_ids, ep.mask) if m]
    assert sampled == odd + call + [tok.eos_token_id] + tok("20126", add_special_tokens=False)["input_ids"] + [
        tok.eos_token_id]
    # the glue between turns is the chat template's own rendering: the whole episode decodes to the template's
    # rendering of the final conversation, but for the trailing glue after the last sampled token (ChatML's "\n")
    rendered = tok.apply_chat_template(ep.messages, tokenize=False)
    assert tok.decode(ep.token_ids, skip_special_tokens=False) + "\n" == rendered


@pytest.mark.parametrize("arguments, problem", [
    ({}, "'expression' is a required property"),
    ({"expression": 347}, "expression: 347 is not of type 'string'"),
    ({"expression": ["347*58"]}, "expression: ['347*58'] is not of type 'string'"),
])
def test_tool_arguments_are_checked_against_the_tools_schema(arguments, problem):
    """A SmolLM2 hermes call whose arguments miss or mistype a parameter: the tool is not called, the observation
    names the problem, the episode goes on and counts one tool error (env/tool_error_rate)."""
    called = []
    tool = Tool("calculator", lambda expression: called.append(expression) or "0", CALCULATOR.description,
                CALCULATOR.parameters)
    tok = smollm2_tokenizer()
    call = tok(f'<tool_call>{{"name": "calculator", "arguments": {json.dumps(arguments)}}}</tool_call>',
               add_special_tokens=False)["input_ids"]
    turns = iter([call + [tok.eos_token_id], tok("I cannot tell.", add_special_tokens=False)["input_ids"]
                  + [tok.eos_token_id]])

    async def generate(context_ids, max_new_tokens):
        ids = next(turns)
        return Turn(ids, [-0.1] * len(ids), tok.decode(ids, skip_special_tokens=True))

    ep = asyncio.run(run_episode(ToolEnv([tool]), ChatTemplateRenderer(tok, [tool]), {"prompt": "What is 347 * 58?"},
                                 0, EpisodeLimits(max_total_tokens=512), generate))
    assert ep.termination == "done" and ep.tool_calls == 1 and ep.tool_errors == 1 and not called
    assert ep.messages[2]["content"] == f"calculator: bad arguments: {problem}"


def test_a_template_that_re_renders_earlier_turns_is_refused():
    tok = smollm2_tokenizer()
    # renders only the last assistant message in full: earlier ones change when a message is added
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>"
                         "assistant\n...<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endif %}{% endfor %}")
    with pytest.raises(TemplateNotPrefixPreserving, match="not prefix-preserving"):
        ChatTemplateRenderer(tok, [CALCULATOR])


def test_custom_environments_load_by_import_path():
    from workers.envs.api import load_environment

    assert load_environment("tool") is ToolEnv
    assert load_environment("tests.test_envs:ThreeTurns") is ThreeTurns
    with pytest.raises(ValueError, match="not a workers.envs.api.Environment"):
        load_environment("tests.test_envs:Turn")
    with pytest.raises(KeyError, match="unknown environment 'nope'"):
        load_environment("nope")


class ThreeTurns(Environment):
    """Used by the end-to-end test: every turn gets the observation {7}; the third ends the episode with a turn
    reward of 0.5 on the second."""

    def reset(self, task, seed):
        self.turns = 0
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, action):
        self.turns += 1
        return StepResult([{"role": "tool", "content": "7"}], reward=0.5 if self.turns == 2 else 0.0,
                          done=self.turns == 3)


def test_a_group_with_an_errored_episode_gets_zero_loss_and_the_metrics_count_it():
    from orchestrator.rl.episode_metrics import drop_errored_groups, episode_metrics
    from workers.records import EpisodeStats, Sample, ScoredSample

    def sample(errored: bool, calls: int, termination: str) -> ScoredSample:
        ep = EpisodeStats(termination, 1 + calls, calls, 0, [0.1] * calls, 3 * calls, 0, [2], [0.0], errored)
        return ScoredSample(Sample("u", 0, "p", [1], [5, 6, 7, 8], [-1.0] * 4, "8", "stop", 0,
                                   loss_mask=[1, 0, 0, 1], episode=ep), 1.0, {})

    groups = [[sample(False, 1, "done"), sample(True, 0, "timeout")], [sample(False, 0, "done"),
                                                                     sample(False, 2, "max_turns")]]
    assert drop_errored_groups(groups) == 1
    assert [x.sample.loss_mask for x in groups[0]] == [[0, 0, 0, 0]] * 2  # the whole group, not just the episode
    assert [x.sample.loss_mask for x in groups[1]] == [[1, 0, 0, 1]] * 2
    m = episode_metrics([x.sample for g in groups for x in g])
    assert m["env/errored_frac"] == 0.25 and m["env/tool_call_rate"] == 0.5 and m["env/tool_calls_mean"] == 0.75
    assert m["env/termination/done"] == 0.5 and m["env/termination/timeout"] == 0.25
    assert m["env/truncated_frac"] == 0.25 and m["env/observation_token_frac"] == 9 / 16


def test_an_episodes_return_is_its_reward_plus_its_environments_turn_rewards():
    """reward/mean is what the advantages are computed from: an agent's own return (or an environment's per-turn
    rewards) counts beside the reward functions' score (with `reward.functions: []` it is all there is)."""
    from orchestrator.rl.episode_metrics import episode_return
    from workers.records import EpisodeStats, Sample, ScoredSample

    ep = EpisodeStats("done", 2, 1, 0, [0.1], 3, 0, [1, 3], [0.25, 1.0], False)
    agent = ScoredSample(Sample("u", 0, "p", [1], [5, 6, 7, 8], [-1.0] * 4, "8", "stop", 0, episode=ep), 0.5, {})
    single = ScoredSample(Sample("u", 1, "p", [1], [5], [-1.0], "8", "stop", 0), 0.5, {})
    assert episode_return(agent) == 1.75 and episode_return(single) == 0.5


def test_tool_demo_sft_trains_exactly_the_tokens_a_tool_episode_samples(tmp_path):
    """`fleetrl data tool-demos` rows rendered for SFT on SmolLM2's real template: the trained sequence is token for
    token the episode a policy writing the same turns produces in the tool environment, and the loss mask is the
    episode's: the two assistant turns (each with its <|im_end|>) trained; the system prompt, the question, the
    tool result and the template's glue not."""
    from orchestrator.config import load_config
    from orchestrator.data import ExampleRenderer, load_sft_rows
    from orchestrator.recipes.tool_demos import write_tool_demos

    cfg = load_config(ROOT / "configs/smollm2_tool.yaml", [f"model.path={SMOLLM2}"])
    out = tmp_path / "demos.jsonl"
    write_tool_demos(cfg, 4, out)
    rows = load_sft_rows(out)
    tok = smollm2_tokenizer()
    for row in rows:
        msgs = row["messages"]
        ex = ExampleRenderer(tok, "chat", cfg.data.system_prompt).sft(msgs, row["tools"])
        turns = [tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                 for m in msgs if m["role"] == "assistant"]
        renderer = ChatTemplateRenderer(tok, [CALCULATOR], cfg.data.system_prompt)
        ep = asyncio.run(run_episode(ToolEnv([CALCULATOR]), renderer, {"prompt": msgs[0]["content"]}, 0,
                                     EpisodeLimits(max_total_tokens=512), writes(tok, turns)))
        assert ep.termination == "done" and ep.tool_calls == 1 and ep.tool_errors == 0
        tool_msgs = [m["content"] for m in ep.messages if m["role"] == "tool"]
        assert tool_msgs == [msgs[2]["content"]]  # the demo's result is the one the real tool returns
        assert ex.prompt_ids == ep.token_ids[:ep.prompt_len]
        completion = ep.token_ids[ep.prompt_len:]
        assert ex.completion_ids[:len(completion)] == completion
        assert ex.loss_mask[:len(completion)] == ep.mask[ep.prompt_len:]
        # what SFT adds after the episode's end is the template's last glue ("\n"), untrained
        assert tok.decode(ex.completion_ids[len(completion):]) == "\n" and not any(ex.loss_mask[len(completion):])
        trained = [t for t, m in zip(ex.completion_ids, ex.loss_mask) if m]
        assert trained == turns[0] + turns[1]  # the tool result between them (same digits as the answer) is not


def writes(tok, turns: list[list[int]]):
    """A policy that samples exactly ``turns`` (token ids), one per call."""
    sampled = iter(turns)

    async def generate(context_ids, max_new_tokens):
        ids = next(sampled)
        return Turn(ids, [-0.1] * len(ids), tok.decode(ids, skip_special_tokens=True))

    return generate


def test_a_tool_call_cut_by_the_length_cap_calls_nothing_and_ends_the_episode_truncated():
    """SmolLM2 writes a hermes call that the per-turn cap cuts before </tool_call>: no tool runs, no observation or
    glue is appended, the episode ends `truncated` with its sampled tokens kept verbatim and trained."""
    called = []
    tool = Tool("calculator", lambda expression: called.append(expression) or "0", CALCULATOR.description,
                CALCULATOR.parameters)
    tok = smollm2_tokenizer()
    full = tok('<tool_call>{"name": "calculator", "arguments": {"expression": "347*58"}}</tool_call>',
               add_special_tokens=False)["input_ids"]
    cut = full[:12]

    async def generate(context_ids, max_new_tokens):
        return Turn(cut, [-0.1] * len(cut), tok.decode(cut, skip_special_tokens=True), "length")

    ep = asyncio.run(run_episode(ToolEnv([tool]), ChatTemplateRenderer(tok, [tool]), {"prompt": "What is 347 * 58?"},
                                 0, EpisodeLimits(max_total_tokens=512, max_new_tokens=12), generate))
    assert ep.termination == "truncated" and ep.tool_calls == 0 and not called
    assert ep.token_ids[ep.prompt_len:] == cut and ep.mask[ep.prompt_len:] == [1] * len(cut)


def test_tool_choice_demos_call_each_problems_own_tool_and_the_metrics_score_the_choice():
    """`tool_choice` problems are half products (calculator), half letter counts (python; the calculator refuses
    them); each demonstration calls its problem's tool and the real result is the answer. `env/right_tool_rate`
    is the share of calling episodes whose first call named the problem's tool, computed from the calls."""
    from orchestrator.recipes.pipeline import config_or_stage
    from orchestrator.recipes.tool_demos import tool_demo_rows
    from orchestrator.rl.episode_metrics import episode_metrics, eval_episode_metrics
    from workers.records import EpisodeStats, Sample

    cfg = config_or_stage(str(ROOT / "configs/smollm2_tools.yaml"), [], writes="tool_demos")
    rows = tool_demo_rows(cfg, 40)
    kinds = {"calculator": "What is", "python": "How many times"}
    for row in rows:
        name = json.loads(row["messages"][1]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert row["messages"][0]["content"].startswith(kinds[name["name"]])
        assert row["messages"][2]["content"].strip() == row["messages"][3]["content"]
    assert 10 < sum("python" in r["messages"][1]["content"] for r in rows) < 30
    with pytest.raises(ValueError):
        calculate("'abcab'.count('a')")

    def sample(tool: str, called: list[str]) -> Sample:
        ep = EpisodeStats("done", 1 + len(called), len(called), 0, [0.1] * len(called), 0, 0, [0], [0.0], False,
                          called)
        return Sample("u", 0, "p", [1], [5], [-1.0], "8", "stop", 0, metadata={"tool": tool}, episode=ep)

    samples = [sample("python", ["python"]), sample("python", ["calculator", "python"]),
               sample("calculator", ["calculator"]), sample("calculator", [])]
    m = episode_metrics(samples)
    assert m["env/right_tool_rate"] == 2 / 3 and m["env/tool_call_rate"] == 0.75
    assert eval_episode_metrics(samples)["eval/right_tool_rate"] == 2 / 3
    del samples[0].metadata["tool"], samples[1].metadata["tool"], samples[2].metadata["tool"]
    assert "env/right_tool_rate" not in episode_metrics(samples)  # a task that names no tool
