"""Prompt rendering (chat template or raw), the pad id, and the learner batch built from samples (pad id from the
tokenizer, truncated completions masked). A tiny real tokenizer with a chat template; no model, no Ray."""

import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from orchestrator.rl.collect import samples_to_batch
from workers.prompts import PromptRenderer, pad_token_id
from workers.records import Sample

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _tokenizer(template: str | None = TEMPLATE, pad: bool = True):
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<eos>", "<pad>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", **({"pad_token": "<pad>"} if pad else {}))
    fast.chat_template = template
    return fast


def test_chat_format_renders_the_template_with_the_system_prompt():
    r = PromptRenderer(_tokenizer(), "auto", system_prompt="Be brief.")
    text, ids = r.render("1+1?")
    assert text == "<system>Be brief.\n<user>1+1?\n<assistant>"
    assert ids == r.tokenizer(text, add_special_tokens=False)["input_ids"]
    # a prompt given as messages keeps its own system message
    text, _ = r.render([{"role": "system", "content": "S"}, {"role": "user", "content": "q"}])
    assert text == "<system>S\n<user>q\n<assistant>"


def test_raw_format_and_auto_without_a_template():
    assert PromptRenderer(_tokenizer(), "raw").render("12+3=")[0] == "12+3="
    r = PromptRenderer(_tokenizer(template=None), "auto")
    assert not r.chat and r.render("12+3=")[0] == "12+3="
    with pytest.raises(ValueError, match="needs data.prompt_format chat"):
        r.render([{"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match="has no chat template"):
        PromptRenderer(_tokenizer(template=None), "chat")


def test_pad_id_comes_from_the_tokenizer_else_eos():
    assert pad_token_id(_tokenizer()) == 2
    assert pad_token_id(_tokenizer(pad=False)) == 1


def _sample(prompt, completion, finish):
    return Sample(prompt_uid="u", sample_index=0, prompt_text="", prompt_ids=prompt, completion_ids=completion,
                  logprobs=[-0.5] * len(completion), completion_text="", finish_reason=finish, policy_version=0)


def test_batch_uses_the_pad_id_and_masks_truncated_completions():
    samples = [_sample([5, 6], [7, 1], "stop"), _sample([5], [8, 9, 9], "length")]
    batch = samples_to_batch(samples, pad_id=2)
    assert batch.input_ids[1, 0] == 2 and batch.input_ids[0, -1] == 2  # left and right padding
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    masked = samples_to_batch(samples, pad_id=2, mask_truncated=True)
    assert masked.response_mask.tolist() == [[1, 1, 0], [0, 0, 0]]
    assert torch.equal(masked.input_ids, batch.input_ids)


def test_data_chat_template_and_its_kwargs_reach_the_rendered_prompt(tmp_path):
    """`data.chat_template` (a file or the text) replaces the tokenizer's template on the engines' spec and in the
    driver's renderer; `data.chat_template_kwargs` reach the template; a mistyped path is refused at load."""
    from orchestrator.config import ConfigError, load_config
    from orchestrator.rl.specs import engine_spec
    from workers.prompts import use_chat_template

    own = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
           "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %} [assistant]")
    path = tmp_path / "template.jinja"
    path.write_text(own)
    inline = tmp_path / "inline.yaml"  # the template text itself, as a YAML config gives it
    inline.write_text(yaml.safe_dump({"data": {"chat_template": own}}))
    for config, given in ((None, [f"data.chat_template={path}"]), (inline, [])):
        cfg = load_config(config, [*given, "data.chat_template_kwargs={enable_thinking: false}"])
        spec = engine_spec(cfg, 64)
        assert spec.chat_template == own and spec.chat_template_kwargs == {"enable_thinking": False}
        r = PromptRenderer(use_chat_template(_tokenizer(template=None), cfg.data.chat_template), "auto",
                           template_kwargs=cfg.data.chat_template_kwargs)
        assert r.render("1+1?")[0] == "[user] 1+1? /no_think [assistant]"
    assert PromptRenderer(use_chat_template(_tokenizer(), None), "chat").render("q")[0] == "<user>q\n<assistant>"
    assert engine_spec(load_config(None, []), 64).chat_template is None
    with pytest.raises(ConfigError, match="neither a file nor a Jinja chat template"):
        load_config(None, [f"data.chat_template={tmp_path / 'templte.jinja'}"])
