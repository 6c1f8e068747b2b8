"""Messages to token ids, without ever decoding and re-encoding history.

An episode's context is the exact ids: the rendered initial messages, then each turn's sampled ids as the engine
returned them, then the ids of what the framework appends after a turn (:meth:`Renderer.after_turn`: the
observation messages and the template's glue around them, up to the next turn's generation prompt). Only new
messages are ever rendered; the ids already in the context are never touched.

- :class:`TextRenderer` (the embedded calculator model): the prompt is the user's text; the model writes a call
  as ``[347*58]`` (the stop string ``]`` ends the turn); the observation is ``{20126}`` (an error: ``{}``, the
  character vocabulary has no words).
- :class:`ChatTemplateRenderer` (real chat models): the tokenizer's chat template, tool calls as hermes
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. What is appended after a turn is the template's
  rendering of the conversation with the new messages minus its rendering up to the assistant turn, plus the
  *trailing glue*: what the template writes after the turn's last sampled token (ChatML: the ``\\n`` after
  ``<|im_end|>``; after a turn cut by the length cap, the end-of-turn marker itself). A template that is not
  prefix-preserving (adding a message changes the rendering of earlier ones) is refused.
"""

from __future__ import annotations

import json
import re

from workers.envs.api import Message, ToolCall


class TemplateNotPrefixPreserving(ValueError):
    """The chat template re-renders earlier messages when one is added: exact-token episodes are impossible."""


class Renderer:
    stop: list[str] = []  # stop strings that end an assistant turn (besides the model's EOS)
    system_prompt: str | None = None

    def conversation(self, messages: list[Message]) -> list[Message]:
        """The episode's conversation from the environment's initial messages: ``system_prompt`` (``data.
        system_prompt``) first when set and the messages have no system message."""
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            return [{"role": "system", "content": self.system_prompt}, *messages]
        return list(messages)

    def initial(self, messages: list[Message]) -> list[int]:
        raise NotImplementedError

    def tool_calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def after_turn(self, conversation: list[Message], sampled_ids: list[int], new: list[Message]) -> list[int]:
        """Ids to append after an assistant turn (``conversation`` ends with it) so that ``new`` messages follow
        and the next turn can start."""
        raise NotImplementedError

    def leaked(self, text: str) -> bool:
        """Whether an assistant turn wrote the observation delimiter itself (the leak canary)."""
        raise NotImplementedError


class TextRenderer(Renderer):
    def __init__(self, tokenizer, tool: str = "calculator", call: tuple[str, str] = ("[", "]"),
                 result: tuple[str, str] = ("{", "}")):
        self.tokenizer, self.tool, self.call, self.result = tokenizer, tool, call, result
        self.stop = [call[1]]
        self.pattern = re.compile(re.escape(call[0]) + r"([^" + re.escape(call[0] + call[1]) + r"]*)" +
                                  re.escape(call[1]))

    def initial(self, messages: list[Message]) -> list[int]:
        users = [m["content"] for m in messages if m["role"] == "user"]
        if len(users) != 1 or len(messages) != 1:
            raise ValueError("the text renderer takes one user message (the prompt); use renderer: chat for "
                             "conversations")
        return self.tokenizer(users[0])["input_ids"]

    def tool_calls(self, text: str) -> list[ToolCall]:
        return [ToolCall(self.tool, {"expression": expr}, f"call-{i}")
                for i, expr in enumerate(self.pattern.findall(text))]

    def after_turn(self, conversation: list[Message], sampled_ids: list[int], new: list[Message]) -> list[int]:
        text = "".join(self.result[0] + ("" if m.get("error") else m["content"]) + self.result[1] for m in new)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def leaked(self, text: str) -> bool:
        return self.result[0] in text


class ChatTemplateRenderer(Renderer):
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def __init__(self, tokenizer, tools: list | None = None, system_prompt: str | None = None):
        self.system_prompt = system_prompt
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"env.renderer=chat: the tokenizer of {tokenizer.name_or_path!r} has no chat template")
        self.tokenizer = tokenizer
        self.tools = [t.schema() for t in tools or []] or None
        check_prefix_preserving(tokenizer)

    def render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def initial(self, messages: list[Message]) -> list[int]:
        return self.ids(self.render(messages, True))

    def tool_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for i, body in enumerate(self.CALL.findall(text)):
            try:
                call = json.loads(body)
                calls.append(ToolCall(str(call["name"]), dict(call.get("arguments") or {}), f"call-{i}"))
            except (ValueError, KeyError, TypeError, AttributeError):
                calls.append(ToolCall("invalid", {"raw": body[:200]}, f"call-{i}"))  # an error observation
        return calls

    def after_turn(self, conversation: list[Message], sampled_ids: list[int], new: list[Message]) -> list[int]:
        before = self.render(conversation, False)
        after = self.render(conversation + new, True)
        if not after.startswith(before):
            raise TemplateNotPrefixPreserving(f"{self.tokenizer.name_or_path}: adding {[m['role'] for m in new]} "
                                              "messages re-rendered earlier ones")
        return self.ids(self.trailing_glue(before, conversation[-1]["content"], sampled_ids) + after[len(before):])

    def trailing_glue(self, rendered: str, content: str, sampled_ids: list[int]) -> str:
        """What the template writes after the turn's last sampled token (never a re-encoding of sampled text)."""
        sampled = self.tokenizer.decode(sampled_ids, skip_special_tokens=False)
        at = rendered.rfind(sampled)
        if at >= 0 and sampled:
            return rendered[at + len(sampled):]
        at = rendered.rfind(content)  # a turn cut by the length cap: the template's end-of-turn is glue too
        if at < 0:
            raise TemplateNotPrefixPreserving(f"{self.tokenizer.name_or_path}: the template changes an assistant "
                                              "turn's text (e.g. strips it), so the sampled tokens are not in its "
                                              "rendering")
        return rendered[at + len(content):]

    def leaked(self, text: str) -> bool:
        return "<tool_response>" in text or "<|im_start|>" in text


def check_prefix_preserving(tokenizer) -> None:
    """Refuse a chat template whose rendering of a conversation is not a prefix of its rendering of a longer one."""
    chat = [{"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "Let me compute it."},
            {"role": "tool", "name": "calculator", "content": "5"},
            {"role": "assistant", "content": "It is 5."},
            {"role": "user", "content": "And 4 + 4?"}]
    for short, long in ((2, 3), (2, 4), (3, 5)):
        a = tokenizer.apply_chat_template(chat[:short], tokenize=False)
        b = tokenizer.apply_chat_template(chat[:long], tokenize=False)
        if not b.startswith(a):
            raise TemplateNotPrefixPreserving(
                f"{tokenizer.name_or_path}: its chat template is not prefix-preserving (adding message "
                f"{short + 1} ({chat[short]['role']}) changes the rendering of the first {short}); multi-turn "
                "episodes need exact tokens, so this template cannot be used (env.renderer: chat)")
