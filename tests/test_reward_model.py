"""The reward-model actor: batching and padding do not change a score; the tiny builder trains and saves a
loadable model; and end to end, `fleetrl train` with `reward.model.path` adds a `reward_model` component."""

import json

import pytest
import torch

from rewards.reward_model import RewardModelWorker, build_tiny_reward_model, encode_pairs, load_reward_model
from tests.test_e2e import run_fleetrl

PAIRS = [("12+30=", "42"), ("7+5=", "13"), ("99+99=", "198"), ("1+1=", ""), ("45+9=", "54"), ("3+4=", "7 7 7")]


def _save_tiny(path, num_labels=1, causal=False):
    """A random tiny Qwen2 (sequence classifier or causal LM) with the embedded char tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from orchestrator.models.embedded_model import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2, num_labels=num_labels)
    model = Qwen2ForCausalLM(cfg) if causal else Qwen2ForSequenceClassification(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("rm"))


def test_batched_scores_equal_unbatched_and_ignore_padding(tiny_rm):
    alone = [RewardModelWorker(tiny_rm, batch_size=1).score([p])[0] for p in PAIRS]
    batched = RewardModelWorker(tiny_rm, batch_size=4).score(PAIRS)
    assert batched == pytest.approx(alone, abs=1e-5)
    # the same pair padded next to a much longer one scores the same
    long = ("1+2=", "3" * 40)
    padded = RewardModelWorker(tiny_rm, batch_size=8).score([PAIRS[1], long])[0]
    assert padded == pytest.approx(alone[1], abs=1e-5)
    assert len(set(round(s, 4) for s in alone)) == len(PAIRS)  # a real function of the text, not a constant


def test_score_is_the_logit_at_the_last_token(tiny_rm):
    tok, model = load_reward_model(tiny_rm)
    ids = tok("12+30=42", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
        expected = float(model.score(hidden)[0])
    assert RewardModelWorker(tiny_rm, batch_size=2).score([("12+30=", "42")])[0] == pytest.approx(expected, abs=1e-5)
    padded_ids, attn = encode_pairs(tok, [("12+30=", "42"), ("1+1=", "2")])
    assert padded_ids[1, -1] == tok.pad_token_id and attn[1].tolist() == [1] * 5 + [0] * 3


def test_a_model_with_more_than_one_output_is_refused(tmp_path):
    path = _save_tiny(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModelWorker(path, batch_size=2)


def test_tiny_reward_model_builder_trains_and_saves(tmp_path):
    policy = _save_tiny(tmp_path / "policy", causal=True)
    summary = build_tiny_reward_model(tmp_path / "rm", policy, steps=5, pairs_per_step=8, num_prompts=32,
                                      samples_per_prompt=2, log=lambda *_: None)
    assert summary["train_pairs"] > 0 and summary["steps"] == 5
    assert summary["held_out_ranking_accuracy"] is None or 0.0 <= summary["held_out_ranking_accuracy"] <= 1.0
    assert json.loads((tmp_path / "rm" / "fleetrl_reward_model.json").read_text()) == summary
    fresh = build_tiny_reward_model(tmp_path / "rm0", policy, steps=0, num_prompts=8, samples_per_prompt=1,
                                    log=lambda *_: None)
    assert fresh["steps"] == 0
    trained = RewardModelWorker(str(tmp_path / "rm"), batch_size=8).score(PAIRS)
    untrained = RewardModelWorker(str(tmp_path / "rm0"), batch_size=8).score(PAIRS)
    assert trained != pytest.approx(untrained, abs=1e-4)  # the supervised steps moved the scores


@pytest.mark.e2e
def test_reward_model_actor_end_to_end(tmp_path, tiny_rm):
    """The real `fleetrl train` with a reward-model actor: every step's reward is the math reward plus
    weight x the reward-model score, and the run completes."""
    run_dir = tmp_path / "run"
    rows = run_fleetrl(run_dir, f"reward.model.path={tiny_rm}", "reward.model.weight=0.5", "reward.model.batch_size=16",
                       "trainer.total_steps=2", "trainer.eval_every=0", "rollout.num_workers=1", "learner.num_ranks=1",
                       "learner.zero_stage=0", "learner.lr=1e-3")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[:2]:
        assert "reward/reward_model" in r and r["reward/reward_model"] != 0.0
        assert r["reward/mean"] == pytest.approx(r["reward/math"] + 0.5 * r["reward/reward_model"], abs=1e-5)
    assert (run_dir / "final" / "config.json").exists()


@pytest.mark.e2e
def test_bradley_terry_reward_model_from_pairs_served_by_the_orm_actor(tmp_path):
    """Only this test guards `algorithm.name: reward_model` with real actors: the learner group trains the
    Bradley-Terry loss on (chosen, rejected) pairs with soft labels (the right sum against a wrong one with a digit
    too many), the held-out ranking accuracy and margin rise, and `final/` is an outcome model that
    `rewards.prm.PRMWorker` (what the `orm-i` actors run) loads and that ranks the held-out pairs as the learner's
    last eval did.

    Step 0 is not chance: each chosen answer is a prefix of its rejected one, so every pair compares the tag's
    log-odds with and without one more digit, a bias of the base model shared by many pairs (0.08-0.53 over six
    `init-model` seeds; the base is trained on the CPU at hand, and a Zen 4 reported 0.71), so the rise is asserted
    against step 0, in accuracy and in mean margin. Fresh AdamW moves every weight (rms ~0.02) by about lr per
    step: at lr 2e-3 without warmup the ranking learned in the first steps collapsed (gradient norms 10-25) and
    came back or not depending on the base model and float order (issue 66). At lr 2e-4 with a 16-step warmup,
    64 steps of 16 pairs end at >= 0.99 of 95 held-out pairs (margin >= 2.9 nats) on every base-model seed, data
    seed, trainer seed and bf16 autocast tried."""
    import random

    from orchestrator.loops.process_reward import held_out
    from rewards.prm import PRMWorker
    from rewards.tasks import make_task

    rng = random.Random(0)
    pairs = tmp_path / "pairs.jsonl"
    rows = []
    for p in make_task("arithmetic").train_batch(0, 400):
        wrong = str(int(p.metadata["answer"]) * 10 + rng.randrange(10))
        rows.append({"prompt": p.text, "chosen": p.metadata["answer"], "rejected": wrong,
                     "preference": rng.choice([1.0, 0.9])})
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    metrics = run_fleetrl(run_dir, "algorithm.name=reward_model", f"algorithm.pairs={pairs}",
                          "algorithm.eval_fraction=0.2", "data.prompts_per_step=16", "rollout.group_size=2",
                          "trainer.total_steps=64", "trainer.eval_every=64", "rollout.num_workers=1",
                          "learner.num_ranks=1", "learner.zero_stage=0", "learner.lr=2e-4", "learner.warmup_steps=16")
    evals = [m for m in metrics if "rm/heldout_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 64]
    first, last = evals
    assert last["rm/heldout_pairs"] >= 80, evals
    assert last["rm/heldout_accuracy"] >= 0.9 and last["rm/heldout_accuracy"] > first["rm/heldout_accuracy"], evals
    assert last["rm/heldout_margin"] >= first["rm/heldout_margin"] + 1.5, evals  # in nats; step 0's is within 0.2
    assert sum("rm/loss" in m for m in metrics) == 64
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())  # the learner group alone: no engine, no reward
    assert not [n for n in logs if n.startswith(("rollout-", "reward-"))] and "learner-0.log" in logs, logs
    final = run_dir / "final"
    assert json.loads((final / "fleetrl_prm.json").read_text())["target"] == "preference"
    held = [r for r in rows if held_out(r, 0.2)]
    served = PRMWorker(str(final), batch_size=16).score([(r["prompt"], [side]) for r in held
                                                         for side in (r["chosen"], r["rejected"])])
    ranked = sum(served[2 * i][-1] > served[2 * i + 1][-1] for i in range(len(held))) / len(held)
    assert ranked == pytest.approx(evals[-1]["rm/heldout_accuracy"], abs=1e-9)
