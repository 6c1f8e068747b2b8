"""SFT, DPO and the recipes built on them: the losses by hand and against TRL, the loss mask of chat rows, pair
batching, data and recipe errors (file, line, key; exit code 2; nothing started), cold-start rows."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from learner.batch import build_batch, position_ids, response_logprobs
from learner.losses import LossScale, dpo_loss, sft_loss
from learner.packing import micro_batches
from orchestrator.config import ConfigError, load_config
from orchestrator.data import Example, ExampleRenderer, draw, examples_batch, load_pairs, load_sft_rows
from orchestrator.recipes.cold_start import addition_steps, cold_start_rows, write_cold_start
from orchestrator.recipes.pipeline import load_recipe
from rewards.datasets import DatasetError
from tests.conftest import subprocess_env
from tests.test_envs import smollm2_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- DPO loss ------------------------------------------------------------------------------------------------------
def test_dpo_loss_by_hand():
    """Two pairs; rows are (chosen, rejected) per pair. Sequence logprobs: pair 0 chosen -1.0 (ref -1.5), rejected
    -2.0 (ref -1.0); pair 1 chosen -3.0 (ref -2.0), rejected -1.0 (ref -1.2). beta = 0.5."""
    logp = torch.tensor([[-0.5, -0.5, 0.0], [-2.0, 0.0, 0.0], [-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.0, -0.5, 0.0], [-1.0, 0.0, 0.0], [-1.0, -1.0, 0.0], [-0.6, -0.6, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    loss, m = dpo_loss(logp, ref, mask, LossScale(4, 9, 3), beta=0.5)
    z0 = 0.5 * ((-1.0 + 1.5) - (-2.0 + 1.0))  # 0.75
    z1 = 0.5 * ((-3.0 + 2.0) - (-1.0 + 1.2))  # -0.6
    expected = (math.log1p(math.exp(-z0)) + math.log1p(math.exp(-z1))) / 2  # -log sigmoid(z) = log(1 + e^-z)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["dpo/reward_margin"].item() == pytest.approx((z0 + z1) / 2, abs=1e-6)
    assert m["dpo/preference_accuracy"].item() == pytest.approx(0.5)
    assert m["dpo/chosen_logp"].item() == pytest.approx(-2.0) and m["dpo/rejected_logp"].item() == pytest.approx(-1.5)
    smoothed, _ = dpo_loss(logp, ref, mask, LossScale(4, 9, 3), beta=0.5, label_smoothing=0.1)
    def ls(z):
        return 0.9 * math.log1p(math.exp(-z)) + 0.1 * math.log1p(math.exp(z))

    assert smoothed.item() == pytest.approx((ls(z0) + ls(z1)) / 2, abs=1e-6)


def test_dpo_loss_splits_over_micro_batches_and_ignores_filler_pairs():
    torch.manual_seed(0)
    logp, ref = -torch.rand(8, 5), -torch.rand(8, 5)
    mask = (torch.rand(8, 5) > 0.3).float()
    mask[:, 0] = 1
    mask[6:] = 0  # a filler pair
    scale = LossScale(6, int(mask.sum()), 5)  # with_scale counts only rows with tokens in a pair batch
    whole, _ = dpo_loss(logp, ref, mask, scale, beta=0.2)
    parts = sum(dpo_loss(logp[i:i + 2], ref[i:i + 2], mask[i:i + 2], scale, beta=0.2)[0] for i in range(0, 8, 2))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)
    alone, _ = dpo_loss(logp[:6], ref[:6], mask[:6], LossScale(6, 0, 5), beta=0.2)
    assert alone.item() == pytest.approx(whole.item(), abs=1e-6)


def test_pair_batches_keep_each_pair_in_one_micro_batch_and_shard():
    ex = [Example([3, 4], [5] * n, [1] * n) for n in (1, 2, 3, 4, 5, 6, 7, 8)]
    batch = examples_batch(ex, 8, pad_id=0, rows_per_unit=2).with_scale()
    assert batch.scale.num_seqs == 8
    for size, budget in ((3, None), (1, None), (None, 9), (None, 1)):
        mbs = micro_batches(batch, size or 2, budget)
        assert all(mb.size % 2 == 0 for mb in mbs) and sum(mb.size for mb in mbs) == 8
        firsts = [int(mb.response_mask[0].sum()) for mb in mbs]
        assert all(f % 2 == 1 for f in firsts)  # every micro-batch starts on a chosen row (odd lengths)
    with pytest.raises(ValueError, match="2-row units"):
        batch.shards(8)
    padded = examples_batch(ex[:2], 8, pad_id=0, rows_per_unit=2).with_scale()
    assert padded.scale.num_seqs == 2 and padded.response_mask[2:].sum() == 0


def test_dpo_loss_equals_trls_dpo_trainer(tmp_path):
    """TRL's DPOTrainer (its own tokenization, batching and log-probs) on two pairs, and fleetrl's dpo_loss on the
    same token rows with fleetrl's response log-probs: the losses agree to 1e-5."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from orchestrator.models.embedded_model import build_model, build_tokenizer

    tok = build_tokenizer()
    policy, ref = build_model(len(tok), 0), build_model(len(tok), 1)
    rows = [{"prompt": "12+30=", "chosen": "42", "rejected": "43"},
            {"prompt": "7+5=", "chosen": "12", "rejected": "2"}, {"prompt": "1+1=", "chosen": "2", "rejected": "11"}]
    args = DPOConfig(output_dir=str(tmp_path), beta=0.3, per_device_train_batch_size=3, report_to=[], use_cpu=True,
                     max_length=32)
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tok)
    inputs = next(iter(trainer.get_train_dataloader()))
    trl_loss = trainer.compute_loss(trainer.model, inputs).item()

    n = len(rows)
    order = [r for k in range(n) for r in (k, k + n)]  # TRL: all chosen, then all rejected; fleetrl: pairs
    ids, attn, comp = (inputs[k][order] for k in ("input_ids", "attention_mask", "completion_mask"))
    prompts = [ids[i][(attn[i] == 1) & (comp[i] == 0)].tolist() for i in range(2 * n)]
    completions = [ids[i][comp[i] == 1].tolist() for i in range(2 * n)]
    batch = build_batch(prompts, completions, [[0.0] * len(c) for c in completions], pad_id=0)

    def logp(model):
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=position_ids(batch.attention_mask)).logits
        return response_logprobs(logits, batch)[0]

    ours, _ = dpo_loss(logp(policy), logp(ref), batch.response_mask, batch.with_scale().scale, beta=0.3)
    assert ours.item() == pytest.approx(trl_loss, abs=1e-5)


# ---- SFT rows: only assistant tokens are trained --------------------------------------------------------------------
def test_sft_loss_gives_exactly_zero_gradient_to_system_user_and_template_tokens():
    """A two-exchange chat row rendered with SmolLM2's ChatML template: the prompt (system + first user turn) is
    outside the trained completion, and inside it the second user turn and the template's glue get exactly zero
    gradient; every assistant content token and its <|im_end|> get a nonzero one."""
    tok = smollm2_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "6"}]
    ex = ExampleRenderer(tok, "chat").sft(msgs)
    assert "Be brief." in tok.decode(ex.prompt_ids) and "2 + 2" in tok.decode(ex.prompt_ids)
    batch = examples_batch([ex], 1, pad_id=tok.pad_token_id or 0).with_scale()
    logp = torch.zeros(batch.response_mask.shape, requires_grad=True)
    loss, _ = sft_loss(logp, batch.response_mask, batch.scale)
    loss.backward()
    trained = tok.decode([t for t, g in zip(ex.completion_ids, logp.grad[0]) if g != 0])
    untrained = tok.decode([t for t, g in zip(ex.completion_ids, logp.grad[0]) if g == 0])
    assert trained == "4<|im_end|>6<|im_end|>"
    assert "And 3 + 3?" in untrained and "<|im_start|>user" in untrained and "<|im_start|>assistant" in untrained
    assert tok.decode(ex.prompt_ids + ex.completion_ids) == tok.apply_chat_template(msgs, tokenize=False)


def test_raw_rows_train_the_response_and_eos(tmp_path):
    from orchestrator.models.embedded_model import build_tokenizer

    tok = build_tokenizer()
    ex = ExampleRenderer(tok, "raw").sft([{"role": "user", "content": "12+30="},
                                         {"role": "assistant", "content": "42"}])
    assert tok.decode(ex.prompt_ids) == "12+30=" and ex.completion_ids[-1] == tok.eos_token_id
    assert ex.loss_mask == [1, 1, 1]
    with pytest.raises(DatasetError, match="chat template"):
        ExampleRenderer(tok, "raw").sft([{"role": "system", "content": "x"}, {"role": "user", "content": "1+1="},
                                         {"role": "assistant", "content": "2"}])


def test_data_errors_name_file_and_line(tmp_path):
    f = tmp_path / "pairs.jsonl"
    f.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "2+2=", "rejected": "5"}\n')
    with pytest.raises(DatasetError, match=r"pairs.jsonl:2: .*missing \['chosen'\]"):
        load_pairs(f)
    f = tmp_path / "sft.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(DatasetError, match=r"sft.jsonl:1: messages have no assistant turn"):
        load_sft_rows(f)
    f.write_text('{"prompt": "1+1=", "response": "2"}\nnot json\n')
    with pytest.raises(DatasetError, match=r"sft.jsonl:2: not valid JSON"):
        load_sft_rows(f)


def test_draw_is_a_seeded_pure_function_of_the_step_covering_each_epoch():
    first = [i for s in range(5) for i in draw(10, s, 2, seed=3)]
    assert sorted(first) == list(range(10)) and draw(10, 7, 4, 3) == draw(10, 7, 4, 3)
    assert draw(10, 0, 4, 3) != draw(10, 0, 4, 4)


# ---- cold-start data ----------------------------------------------------------------------------------------------
def test_addition_steps_write_every_column_and_carry():
    assert addition_steps(47, 38, compact=True) == "7+8=15 4+3+1=8"
    assert addition_steps(95, 7, compact=True) == "5+7=12 9+0+1=10"
    assert "Tens: 4 + 3 + 1 (carry) = 8" in addition_steps(47, 38, compact=False)


@pytest.mark.parametrize("overrides", [[], ["data.prompt_style=text"], ["data.task=countdown"]])
def test_cold_start_rows_pass_the_tasks_verifier_and_the_format_reward(tmp_path, overrides):
    from rewards.functions import format_reward, load_reward_function
    from rewards.tasks import make_task_from_config

    data = load_config(None, overrides).data
    task = make_task_from_config(data)
    verifier = load_reward_function(task.verifier)
    pairs = cold_start_rows(data, 20)
    for row, meta in pairs:
        assert row["response"].startswith("<think>") and format_reward("", row["response"], meta) == 1.0
        assert verifier(row["prompt"], row["response"], meta) == 1.0
        steps = row["response"].rpartition("</think>")[0] + "</think>"
        wrong = steps + ("<answer> 1 </answer>" if data.task == "countdown" else "1000")
        assert verifier(row["prompt"], wrong, meta) < 1.0  # the verifier reads the answer after </think>
    held_out = {p.text for p in task.eval_set(400)}
    assert not {r["prompt"] for r, _ in pairs} & held_out and len({r["prompt"] for r, _ in pairs}) > 10
    info = write_cold_start(data, 20, tmp_path / "cs.jsonl")
    assert [json.loads(x) for x in (tmp_path / "cs.jsonl").read_text().splitlines()] == [r for r, _ in pairs]
    assert info["rows"] == 20


# ---- recipes: bad input stops before anything starts ---------------------------------------------------------------
def _recipe(tmp_path, text: str):
    f = tmp_path / "recipe.yaml"
    f.write_text(text)
    return f


def _pipeline(recipe, *overrides):
    env = subprocess_env(RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1")
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "orchestrator", "pipeline", "-c", str(recipe), *overrides], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


BASE = "base: {run: {dir: %s}}\n"


@pytest.mark.parametrize("stages, message", [
    ("[{name: a, kind: train}]",
     r"stage 1 \(a\): unknown kind 'train'; allowed: \['distill', 'dpo', 'reward_model', 'rft', 'rl'"),
    ("[{name: a, kind: rl, steps: 3}]", r"stage 1: unknown key\(s\) \['steps'\]"),
    ("[{name: a, kind: rl, overrides: {learner.lrr: 1}}]", r"stage 1 \(a\).*learner.lrr"),
    ("[{name: a, kind: sft, overrides: {sft.data: PAIRS}}]", r"stage 1 \(a\): .*pairs.jsonl:1: a row needs"),
    ("[{name: a, kind: dpo, overrides: {algorithm.pairs: PAIRS}}]", r"stage 1 \(a\): .*pairs.jsonl:2: .*chosen"),
    ("[{name: a, kind: sft, overrides: {sft.data: MSGS}}]", r"msgs.jsonl:1: messages have no assistant turn"),
    ("[{name: a, kind: distill, overrides: {distill.teacher: /nonexistent/teacher}}]",
     r"distill.teacher: '/nonexistent/teacher' is not a model directory"),
    ("[{name: a, kind: rl, tool_demos: 10}]", r"stage 1 \(a\): the rows to write first .*tool_demos \(sft\).* on a "
     r"stage of that kind.* on a rl stage"),
    ("[{name: a, kind: sft, ai_preferences: 10}]", r"ai_preferences \(dpo\|reward_model\), on a stage of that kind"),
    ("[{name: a, kind: reward_model}]", r"stage 1 \(a\): algorithm.pairs: a reward_model stage trains on preference"),
    ("[{name: a, kind: sft, cold_start: 10, tool_demos: 10}]", r"are one of"),
])
def test_bad_recipes_exit_2_naming_stage_key_file_and_line_and_start_nothing(tmp_path, stages, message):
    pairs, msgs = tmp_path / "pairs.jsonl", tmp_path / "msgs.jsonl"
    pairs.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "2+2=", "rejected": "5"}\n')
    msgs.write_text('{"messages": [{"role": "user", "content": "1+1="}]}\n')
    run_dir = tmp_path / "run"
    recipe = _recipe(tmp_path, BASE % run_dir + "stages: " + stages.replace("PAIRS", str(pairs)).replace(
        "MSGS", str(msgs)) + "\n")
    proc = _pipeline(recipe)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    import re

    assert re.search(message, proc.stderr, re.S), proc.stderr
    assert not run_dir.exists()


def test_recipe_stages_chain_models_and_command_line_overrides_apply_to_every_stage(tmp_path):
    recipe = _recipe(tmp_path, BASE % (tmp_path / "run") + """stages:
  - {name: warm, kind: sft, cold_start: 100, overrides: {trainer.total_steps: 50}}
  - {name: rl, kind: rl, overrides: {trainer.total_steps: 40, algorithm.name: rloo}}
  - {name: pref, kind: dpo, overrides: {algorithm.beta: 0.2}}
""")
    stages = load_recipe(recipe, ["trainer.total_steps=2"])
    assert [s.cfg.trainer.total_steps for s in stages] == [2, 2, 2]
    assert stages[1].cfg.model.path == str(tmp_path / "run" / "01-warm" / "final")
    assert stages[2].cfg.model.path == str(tmp_path / "run" / "02-rl" / "final")
    assert stages[1].cfg.algorithm.name == "rloo" and stages[2].cfg.algorithm.name == "dpo"
    assert stages[2].cfg.algorithm.beta == 0.2
    assert [s.cfg.data.seed for s in stages] == [0, 1, 2]  # each stage trains on prompts of its own
    assert [s.cfg.data.seed for s in load_recipe(recipe, ["data.seed=7"])] == [7, 8, 9]
    with pytest.raises(ConfigError, match="unknown recipe key"):
        load_recipe(_recipe(tmp_path, "stagez: []\n"), [])


def test_submit_checks_a_recipe_like_the_pipeline_before_contacting_the_cluster(tmp_path):
    from orchestrator.cli.jobs import submit
    from orchestrator.recipes.pipeline import is_recipe

    bad = _recipe(tmp_path, BASE % (tmp_path / "run") + "stages: [{name: a, kind: sftt}]\n")
    assert is_recipe(str(bad)) and not is_recipe(os.path.join(ROOT, "configs", "default.yaml"))
    with pytest.raises(ConfigError, match=r"stage 1 \(a\): unknown kind 'sftt'"):
        submit(str(bad), [], address="http://127.0.0.1:9")  # nothing listens there: it must fail before


@pytest.mark.parametrize("recipe", ["r1.yaml", "r1_zero.yaml", "smollm2_r1.yaml", "smollm2_r1_zero.yaml",
                                    "smollm2_tools.yaml", "smollm2_cai.yaml"])
def test_shipped_recipes_validate_and_chain_their_stages(recipe):
    stages = load_recipe(os.path.join(ROOT, "configs", recipe), [])
    assert stages[0].cfg.model.path.startswith(".fleetrl/models/")
    for before, st in zip(stages, stages[1:]):
        assert st.cfg.model.path == str(before.dir / "final")
    if "tools" in recipe:
        assert stages[0].writes == ("tool_demos", 400) and all(s.cfg.env.name == "tool" for s in stages)
    elif "cai" in recipe:
        assert [(s.kind, s.writes) for s in stages] == [("sft", ("cai_revisions", 256)),
                                                        ("dpo", ("ai_preferences", 128))]
    else:
        assert {s.cfg.reward.functions[1].name for s in stages if s.kind == "rl"} == {"format"}
