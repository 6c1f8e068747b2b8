"""Prompts to the engine's tokens: the tokenizer's chat template, or raw text.

A prompt is a string (one user turn) or a list of chat messages (``[{"role": ..., "content": ...}, ...]``).
``chat`` renders it with ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` (a system
message first when ``system_prompt`` is set and the messages have none); ``raw`` tokenizes the string as is;
``auto`` is ``chat`` when the tokenizer has a chat template. ``data.chat_template`` replaces the tokenizer's
template (:func:`use_chat_template`, where a run's tokenizers are loaded) and ``data.chat_template_kwargs`` are
passed to every ``apply_chat_template`` call of the renderer (e.g. ``enable_thinking: false``). The rendered text
and its ids are what the engine sees, and what a sample records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

PromptFormat = Literal["auto", "chat", "raw"]
Messages = list[dict]


class PromptRenderer:
    def __init__(self, tokenizer, prompt_format: PromptFormat = "auto", system_prompt: str | None = None,
                 template_kwargs: dict | None = None):
        if prompt_format not in ("auto", "chat", "raw"):
            raise ValueError(f"data.prompt_format must be one of auto, chat, raw; got {prompt_format!r}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if prompt_format == "chat" and not has_template:
            raise ValueError(f"data.prompt_format=chat but the tokenizer of {tokenizer.name_or_path!r} has no chat "
                             "template; use prompt_format: raw (or auto)")
        self.tokenizer = tokenizer
        self.chat = prompt_format == "chat" or (prompt_format == "auto" and has_template)
        self.system_prompt = system_prompt
        self.template_kwargs = dict(template_kwargs or {})

    def messages(self, prompt: str | Messages) -> Messages:
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def render(self, prompt: str | Messages, tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """``(text, token ids)`` exactly as the engine gets them; ``tools``: function schemas the chat template
        renders (as a tool episode's renderer passes them)."""
        if self.chat:
            text = self.tokenizer.apply_chat_template(self.messages(prompt), tools=tools, add_generation_prompt=True,
                                                      tokenize=False, **self.template_kwargs)
            return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not isinstance(prompt, str):
            raise ValueError("a prompt given as chat messages needs data.prompt_format chat (or auto with a "
                             "tokenizer that has a chat template)")
        return prompt, self.tokenizer(prompt)["input_ids"]


def read_chat_template(value: str) -> str:
    """``data.chat_template``'s Jinja text: the file ``value`` names, else ``value`` itself when it is a template
    (has ``{{`` or ``{%``); anything else is a ValueError (a mistyped path must not become the template)."""
    path = Path(value).expanduser()
    if "{{" not in value and "{%" not in value:
        if not path.is_file():
            raise ValueError(f"{value!r} is neither a file nor a Jinja chat template (no '{{{{' or '{{%')")
        return path.read_text()
    return value


def use_chat_template(tokenizer, template: str | None):
    """``tokenizer`` with ``data.chat_template`` (a file or the template text, :func:`read_chat_template`) as its
    chat template, so every renderer that uses it (prompts, episodes, SFT rows) renders with it; unchanged when
    ``template`` is None."""
    if template is not None:
        tokenizer.chat_template = read_chat_template(template)
    return tokenizer


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, else its EOS id (never a made-up 0)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    raise ValueError(f"tokenizer of {tokenizer.name_or_path!r} has neither a pad nor an EOS token")
