"""Constitutional AI: principles, the judge's option probabilities, soft-label DPO, the rule checks,
bad input; and one tiny SL-CAI -> RL-CAI pipeline with real actors on SmolLM2."""

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.losses import LossScale, bradley_terry_loss, dpo_loss
from orchestrator.config import ConfigError, load_config
from orchestrator.data import load_pairs
from orchestrator.recipes.cai import applicable, check_judge
from rewards.constitution import (
    ConstitutionError,
    constitution_reward,
    keeps_secret,
    load_constitution,
    no_digits,
    one_sentence,
    option_probabilities,
    option_token_ids,
    preference_from_orders,
)
from rewards.datasets import DatasetError
from rewards.tasks import make_task

ROOT = Path(__file__).resolve().parents[1]


def test_option_probabilities_and_both_orders_by_hand():
    p = option_probabilities([-1.2, -2.3])
    assert p[0] == pytest.approx(math.exp(-1.2) / (math.exp(-1.2) + math.exp(-2.3)), abs=1e-12)
    assert p[0] == pytest.approx(1 / (1 + math.exp(-1.1)), abs=1e-12) and sum(p) == pytest.approx(1.0)
    assert option_probabilities([-800.0, -801.0])[0] == pytest.approx(1 / (1 + math.exp(-1)))  # no underflow
    # asked (a, b): P(A) = 0.8; asked (b, a): P(B) = 0.7 -> P(a is better) = 0.75; a judge that always says A: 0.5
    assert preference_from_orders([0.8, 0.2], [0.3, 0.7]) == pytest.approx(0.75)
    assert preference_from_orders([0.9, 0.1], [0.9, 0.1]) == pytest.approx(0.5)
    assert preference_from_orders([0.8, 0.2]) == 0.8


def _pairs(logp_rows, ref_rows):
    logp, ref = torch.tensor(logp_rows, requires_grad=True), torch.tensor(ref_rows)
    return logp, ref, torch.ones_like(ref)


def test_soft_label_dpo_loss_and_gradient_by_hand():
    """Two pairs; pair 0 soft label 0.8, pair 1 hard (1.0). z = beta ((c - c0) - (r - r0)); loss per pair
    -q log sig(z) - (1 - q) log sig(-z), mean over pairs; d loss / d c = beta (sig(z) - q) / pairs."""
    beta = 0.5
    logp, ref, mask = _pairs([[-1.0, -2.0], [-3.0, -1.5], [-0.5, -0.5], [-2.0, -2.0]],
                             [[-1.5, -1.5], [-2.0, -2.0], [-1.0, -1.0], [-1.0, -1.0]])
    targets = torch.tensor([[0.8, 0.8], [0.8, 0.8], [1.0, 1.0], [1.0, 1.0]])
    loss, metrics = dpo_loss(logp, ref, mask, LossScale(4, 8, 2), targets, beta=beta)
    z = [beta * ((-3.0 + 3.0) - (-4.5 + 4.0)), beta * ((-1.0 + 2.0) - (-4.0 + 2.0))]  # 0.25, 1.5
    sig = [1 / (1 + math.exp(-v)) for v in z]
    per = [-(0.8 * math.log(sig[0]) + 0.2 * math.log(1 - sig[0])), -math.log(sig[1])]
    assert loss.item() == pytest.approx(sum(per) / 2, abs=1e-6)
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(beta * (sig[0] - 0.8) / 2, abs=1e-6)  # chosen token of pair 0
    assert logp.grad[1, 0].item() == pytest.approx(-beta * (sig[0] - 0.8) / 2, abs=1e-6)
    # label 1 everywhere is the hard loss; label smoothing 0.1 on a soft label 0.8 gives q = 0.74
    hard, _ = dpo_loss(logp.detach(), ref, mask, LossScale(4, 8, 2), beta=beta)
    assert hard.item() == pytest.approx(-(math.log(sig[0]) + math.log(sig[1])) / 2, abs=1e-6)
    smooth, _ = dpo_loss(logp.detach(), ref, mask, LossScale(4, 8, 2), targets, beta=beta, label_smoothing=0.1)
    q = 0.8 * 0.9 + 0.2 * 0.1
    want = -(q * math.log(sig[0]) + (1 - q) * math.log(1 - sig[0])) - (0.9 * math.log(sig[1]) +
                                                                        0.1 * math.log(1 - sig[1]))
    assert smooth.item() == pytest.approx(want / 2, abs=1e-6)


def test_bradley_terry_loss_and_gradient_by_hand():
    """Two pairs, the tag logp at one masked position per row. Score r = log p - log(1 - p); z = r_c - r_r; loss
    per pair -q log sig(z) - (1 - q) log sig(-z), mean over pairs; d loss / d logp_c = (sig(z) - q) / (1 - p_c)
    / pairs (d r / d logp = 1 / (1 - p)). A filler pair (empty rows) adds nothing."""
    logp = torch.tensor([[0.0, -0.2], [0.0, -1.5], [-0.7, 0.0], [-0.4, 0.0], [-0.3, 0.0], [-0.3, 0.0]],
                        requires_grad=True)
    mask = torch.tensor([[0, 1], [0, 1], [1, 0], [1, 0], [0, 0], [0, 0]], dtype=torch.float32)
    targets = mask * torch.tensor([[0.9], [0.9], [1.0], [1.0], [1.0], [1.0]])
    loss, metrics = bradley_terry_loss(logp, mask, LossScale(6, 4, 2), targets)

    def r(lp):
        return lp - math.log(1 - math.exp(lp))
    z = [r(-0.2) - r(-1.5), r(-0.7) - r(-0.4)]
    sig = [1 / (1 + math.exp(-v)) for v in z]
    per = [-(0.9 * math.log(sig[0]) + 0.1 * math.log(1 - sig[0])), -math.log(sig[1])]
    assert loss.item() == pytest.approx(sum(per) / 3, abs=1e-6)  # 3 pairs in the minibatch, one a filler
    assert metrics["rm/accuracy"].item() == pytest.approx(1 / 3) and z[0] > 0 > z[1]
    loss.backward()
    assert logp.grad[0, 1].item() == pytest.approx((sig[0] - 0.9) / (1 - math.exp(-0.2)) / 3, abs=1e-6)
    assert logp.grad[1, 1].item() == pytest.approx(-(sig[0] - 0.9) / (1 - math.exp(-1.5)) / 3, abs=1e-6)
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[4:].abs().sum().item() == 0.0
    hard, _ = bradley_terry_loss(logp.detach(), mask, LossScale(6, 4, 2))
    assert hard.item() == pytest.approx(-(math.log(sig[0]) + math.log(sig[1])) / 3, abs=1e-6)


class _Engines:
    """Stands in for the judge's engines (a RolloutPool's ``option_logprobs``): answers "Yes" with the log-odds
    it is given per response, None for a response marked too long, and records the calls."""

    def __init__(self, yes_logodds: dict[str, float], fail: bool = False):
        self.yes, self.fail, self.calls = yes_logodds, fail, []

    def option_logprobs(self, questions, prefix, option_ids):
        self.calls.append(len(questions))
        if self.fail:
            raise RuntimeError("engine died")
        out = []
        for q in questions:
            text = q[-1]["content"]
            response = next(k for k in self.yes if f"Assistant: {k}\n" in text)
            if self.yes[response] is None:
                out.append(None)
                continue
            yes_first = "(A) Yes" in text
            a = self.yes[response]
            out.append([a, 0.0] if yes_first else [0.0, a])
        return out


def test_the_judge_reward_batches_a_step_and_counts_what_it_cannot_read():
    """One call for every rubric question of the step (both orders); each response's score is its mean P(yes)
    over the principles that apply to its prompt; an unreadable verdict scores on_error and is counted."""
    from rewards.judge import Judge

    c = load_constitution()
    conv = [{"role": "user", "content": "Tell me about cats."}]
    items = [(conv, "Cats purr.", {"checks": ["one_sentence"]}),
             (conv, "Cats sleep.", {"checks": ["no_digits", "one_sentence"], "words": True}),
             (conv, "Too long.", {"checks": ["one_sentence"]})]
    engines = _Engines({"Cats purr.": 2.0, "Cats sleep.": -1.0, "Too long.": None})
    judge = Judge(c, [49, 50], both_orders=True, on_error=-1.0)
    scores, errors = judge.score(engines, items)
    assert engines.calls == [2 * (1 + 2 + 1)]  # one batched call: 4 questions, each in both orders
    assert scores[0] == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert scores[1] == pytest.approx(1 / (1 + math.exp(1.0)))
    assert scores[2] == -1.0 and errors == 1
    down = _Engines({}, fail=True)
    assert judge.score(down, items) == ([-1.0, -1.0, -1.0], 3)
    with pytest.raises(RuntimeError, match="engine died"):  # reward.strict: a failing judge stops the run
        Judge(c, [49, 50], strict=True).score(down, items)


def test_judge_reward_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"judge: unknown params \['bogus'\]; allowed: \['on_error'\]"):
        load_config(None, ["reward.functions=[{name: judge, params: {bogus: 1}}]"])
    with pytest.raises(ConfigError, match=r"judge needs cai.judge: policy or model"):
        load_config(None, ["reward.functions=[{name: judge}]", "cai.judge=rule"])
    with pytest.raises(ConfigError, match=r"params.on_error must be a finite number, got 'low'"):
        load_config(None, ["reward.functions=[{name: judge, params: {on_error: low}}]"])
    with pytest.raises(ConfigError, match=r"judge is listed more than once"):
        load_config(None, ["reward.functions=[{name: judge}, {name: judge}]"])
    with pytest.raises(ConfigError, match=r"data.prompt_format raw has none"):
        load_config(None, ["reward.functions=[{name: judge}]", "data.prompt_format=raw"])
    principles = tmp_path / "p.yaml"
    principles.write_text("principles: [{name: x, critique: c, revision: r, preference: p}]")
    with pytest.raises(ConfigError, match=r"p.yaml has none for \['x'\]"):
        load_config(None, ["reward.functions=[{name: judge}]", f"cai.principles={principles}"])
    assert load_config(None, ["reward.functions=[{name: judge, params: {on_error: 0.5}}]"]).judge_spec.params == \
        {"on_error": 0.5}


def test_preference_rows_carry_a_checked_soft_label(tmp_path):
    good = tmp_path / "pairs.jsonl"
    good.write_text('{"prompt": "q", "chosen": "a", "rejected": "b", "preference": 0.75}\n'
                    '{"prompt": "q", "chosen": "a", "rejected": "b"}\n')
    assert [r["preference"] for r in load_pairs(good)] == [0.75, 1.0]
    for bad in ("1.5", "true", '"high"'):
        path = tmp_path / "bad.jsonl"
        path.write_text(f'{{"prompt": "q", "chosen": "a", "rejected": "b", "preference": {bad}}}\n')
        with pytest.raises(DatasetError, match=r"bad.jsonl:1: 'preference' .* in \[0, 1\]"):
            load_pairs(path)


def test_rule_checks_of_the_principles():
    assert one_sentence("", "Cats are small furry animals.", {}) == 1.0
    assert one_sentence("", "Pi is 3.14 and more.", {}) == 1.0  # a decimal point ends no sentence
    assert one_sentence("", "Cats purr. They sleep a lot.", {}) == 0.0
    assert one_sentence("", "", {}) == 0.0
    meta = {"secret": "tulip"}
    assert keeps_secret("", "I cannot share that word.", meta) == 1.0
    for leak in ("It is TULIP.", "t-u-l-i-p", "T U L I P", "Backwards: pilut.", "p.i.l.u.t"):
        assert keeps_secret("", leak, meta) == 0.0, leak
    assert keeps_secret("", "but u lip", meta) == 1.0  # letters of other words are no spelling
    assert no_digits("", "Eight legs.", {"words": True}) == 1.0 and no_digits("", "8 legs.", {"words": True}) == 0.0
    assert no_digits("", "8 legs.", {}) == 1.0  # not asked for words
    assert constitution_reward("", "It has 8 legs.", {"checks": ["no_digits", "one_sentence"], "words": True}) == \
        {"no_digits": 0.0, "one_sentence": 1.0}


def test_constitution_task_prompts_their_checks_and_applicable_principles():
    task = make_task("constitution")
    held_out = task.eval_set(200)
    assert len(held_out) == 95 and held_out == make_task("constitution").eval_set(200)
    keys = {json.dumps(p.text) for p in held_out}
    import random

    train = task.draw_train(random.Random(0), 300)
    assert not keys & {json.dumps(text) for text, _ in train}
    c = load_constitution()
    secret = next(p for p in held_out if "secret" in p.metadata)
    assert secret.text[0]["role"] == "system" and secret.metadata["secret"] in secret.text[0]["content"]
    assert [p.name for p in applicable(c, secret.metadata)] == ["one_sentence", "keeps_secret"]
    assert [p.name for p in applicable(c, {})] == ["one_sentence", "keeps_secret", "no_digits"]


@pytest.mark.parametrize("text, message", [
    ("principles: [", r"bad.yaml: not valid YAML"),
    ("- a\n", r"bad.yaml: top level must be a mapping, got list"),
    ("principles: []", r"bad.yaml: principles: List should have at least 1 item"),
    ("principles: [{name: x, critique: c, preference: p}]", r"bad.yaml: principles.0.revision: Field required"),
    ("principles: [{name: x, critique: c, revision: r, preference: p, rule: nope}]",
     r"bad.yaml: principles.0.rule: .*unknown reward function 'nope'"),
    ("principles: [{name: x, critique: c, revision: r, preference: p}, {name: x, critique: c, revision: r, "
     "preference: p}]", r"repeated: \['x'\]"),
    ("options: [A, A]\nprinciples: [{name: x, critique: c, revision: r, preference: p}]", r"options: .*distinct"),
])
def test_a_malformed_principles_file_names_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConstitutionError, match=message):
        load_constitution(path)
    with pytest.raises(ConfigError, match=r"cai: .*" + message.split(":")[0]):  # the config names its key
        load_config(None, [f"cai.principles={path}"])


def test_options_must_be_single_tokens_and_the_judge_a_causal_lm(tmp_path, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    smollm2 = smollm2_tokenizer_dir  # the tokenizer and config.json are all these checks read

    tok = AutoTokenizer.from_pretrained(smollm2)
    assert option_token_ids(tok, ["A", "B"]) == [49, 50]
    with pytest.raises(ConstitutionError, match=r"options: 'Yes indeed' is not one token"):
        option_token_ids(tok, ["A", "Yes indeed"])
    principles = tmp_path / "p.yaml"
    principles.write_text("options: [A, Maybe so]\nprinciples: [{name: x, critique: c, revision: r, preference: p}]")
    base = [f"model.path={smollm2}", "data.task=constitution"]
    with pytest.raises(ConfigError, match=r"cai.principles .*p.yaml: options: 'Maybe so' is not one token"):
        check_judge(load_config(None, [*base, f"cai.principles={principles}"]), load_constitution(principles))
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    with pytest.raises(ConfigError, match=r"cai.feedback_model: .* is not a causal LM"):
        check_judge(load_config(None, [*base, "cai.judge=model", f"cai.feedback_model={rm}"]), load_constitution())


def test_cai_prefer_with_a_bad_judge_exits_2_before_starting_anything(tmp_path, smollm2_tokenizer_dir):
    smollm2 = smollm2_tokenizer_dir  # no weights: nothing may load them before the judge is refused
    out = tmp_path / "pairs.jsonl"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "cai", "prefer", "--n", "4", "--out", str(out),
                           f"model.path={smollm2}", "data.task=constitution", "cai.judge=model",
                           f"cai.feedback_model={tmp_path}", f"run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "cai.feedback_model" in proc.stderr and "not a model directory" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists() and not (tmp_path / "run").exists()


TINY = """base:
  model: {path: %s}
  data: {task: constitution, prompt_format: chat, prompts_per_step: 2, eval_size: 4, max_prompt_tokens: 512}
  rollout: {num_workers: 1, group_size: 2, max_new_tokens: 24, temperature: 1.0, dtype: float32, kv_cache_gib: 1.5}
  reward: {num_workers: 1, functions: [{name: constitution}]}
  learner: {num_ranks: 1, zero_stage: 0, lr: 1.0e-5, micro_batch_tokens: 1024}
  trainer: {total_steps: 1, eval_every: 0}
  run: {dir: %s}
stages:
  - {name: sl_cai, kind: sft, cai_revisions: 64}
  - {name: rl_cai, kind: dpo, ai_preferences: 4}
  - name: rl_judge
    kind: rl
    overrides: {reward.functions: [{name: judge}, {name: constitution, weight: 0.0}], run.dump_rollouts: true}
"""


@pytest.mark.e2e
def test_sl_cai_then_rl_cai_in_a_pipeline_and_the_judges_probabilities_are_the_models(tmp_path, smollm2):
    """Only this test guards the Constitutional AI stages with real engines: answers critiqued and revised
    (SFT rows), then response pairs labelled by the policy as judge (soft DPO pairs), each a `fleetrl cai`
    process before its stage trains, then a GRPO step rewarded by the `judge` reward; and that the option
    probabilities the engines read from vLLM's prompt logprobs are the model's own, recomputed here with
    transformers (fp32, < 1e-4; the labels are 0.50-0.53 here, so a misread position fails), for the pairs'
    labels and for every judged sample's reward. The 64 critique turns are one seeded call whose new prompt
    tokens pass the engine's 4096-token step budget: vLLM's CPU runner crashed on a seeded prefill split across
    steps. The KV cache (1.5 GiB) holds all 64 at once: with 0.1 GiB it held 3-4, no step came near the budget,
    and this test passed with whole-prompt prefill turned off; now it fails so (seen)."""
    from tests.conftest import fleetrl

    run_dir = tmp_path / "cai"
    recipe = tmp_path / "cai.yaml"
    recipe.write_text(TINY % (smollm2, run_dir))
    proc = fleetrl("pipeline", "-c", str(recipe), timeout=900)  # on the session's fleet
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    stages = json.loads((run_dir / "summary.json").read_text())["stages"]
    assert [s["status"] for s in stages] == ["finished", "finished", "finished"]
    revised = [json.loads(line) for line in (run_dir / "01-sl_cai/cai_revisions.jsonl").read_text().splitlines()]
    assert 56 <= len(revised) <= 64  # a conversation whose revision came out empty is no SFT row
    for row in revised:
        assert row["messages"][-1] == {"role": "assistant", "content": row["revisions"][-1]}
        assert len(row["revisions"]) == 2 and len(row["critiques"]) == len(row["principles"]) == 1
    pairs = load_pairs(run_dir / "02-rl_cai/ai_preferences.jsonl")
    assert pairs and all(0.5 <= p["preference"] <= 1.0 for p in pairs)
    dpo = [json.loads(line) for line in (run_dir / "02-rl_cai/metrics.jsonl").read_text().splitlines()]
    assert any(r.get("dpo/pairs") == 2 for r in dpo)
    raw = [json.loads(line) for line in (run_dir / "02-rl_cai/ai_preferences.jsonl").read_text().splitlines()]
    judge = run_dir / "01-sl_cai/final"  # stage 2 starts from stage 1's model: the policy that judges
    c = load_constitution()
    for row, checked in zip(raw, pairs):
        want = _transformers_preference(judge, row["prompt"], row["chosen"], row["rejected"],
                                        c.by_name(row["principle"]))
        assert abs(want - checked["preference"]) < 1e-4, (want, checked["preference"])  # measured: <= 1e-5
    _check_judge_rewards(run_dir / "03-rl_judge", judge=run_dir / "02-rl_cai/final", principles=c)
    # the engines sat parked through the DPO stage's training (plan_serve): the RL stage reused them
    kept = json.loads((run_dir / "03-rl_judge" / "summary.json").read_text())["fleet_kept"]
    assert {"learner", "rollout"} <= set(kept), kept


def _check_judge_rewards(stage_dir: Path, judge: Path, principles) -> None:
    """Every sample of the judge-rewarded step scored its mean P(yes) over its prompt's principles, as
    transformers computes it with the stage's starting policy (the judge); no judge errors."""
    from orchestrator.rl.launch import make_task
    from rewards.constitution import rubric_question
    from rewards.judge import applicable

    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "reward/judge" in r)
    assert step["reward/judge_errors"] == 0 and 0.0 < step["reward/judge"] < 1.0
    prompts = {p.uid: p for p in make_task(load_config(stage_dir / "config.yaml")).train_batch(0, 2)}
    dumped = [json.loads(line) for line in (stage_dir / "rollouts/step_000000.jsonl").read_text().splitlines()]
    assert len(dumped) == 4
    for row in dumped:
        p = prompts[row["uid"]]
        yes = [_transformers_options(judge, rubric_question(p.text, row["completion"], pr, ["A", "B"], first))
               [0 if first else 1] for pr in applicable(principles, p.metadata) for first in (True, False)]
        assert abs(sum(yes) / len(yes) - row["components"]["judge"]) < 1e-4, (yes, row["components"])


@functools.lru_cache(maxsize=2)
def _transformers_model(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir), \
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _transformers_options(model_dir, question: list[dict]) -> list[float]:
    """The option letters' next-token probabilities (normalized over A and B) after ``question`` rendered by the
    tokenizer's chat template with ANSWER_PREFIX after it, from transformers."""
    from rewards.constitution import ANSWER_PREFIX

    tok, model = _transformers_model(model_dir)
    ids = [tok(o, add_special_tokens=False)["input_ids"][-1] for o in ("A", "B")]
    text = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    x = tok(text, add_special_tokens=False)["input_ids"] + tok(ANSWER_PREFIX, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([x])).logits[0, -1].double(), -1)
    return option_probabilities([logp[i].item() for i in ids])


def _transformers_preference(model_dir, prompt, chosen, rejected, principle) -> float:
    """P(chosen is better) from transformers: the question asked in both orders, averaged."""
    from rewards.constitution import preference_question

    probs = [_transformers_options(model_dir, preference_question(prompt, [first, second], principle, ["A", "B"]))
             for first, second in ((chosen, rejected), (rejected, chosen))]
    return (probs[0][0] + probs[1][1]) / 2
