"""The text of one choice as it streams: decoding, the thinking split, stop strings, tool calls, and
what may be sent yet."""

from __future__ import annotations

from ..chat import split_partial
from .protocol import ToolPlan


class Choice:
    def __init__(self, tokenizer, stops: list[str], think: bool, tools: ToolPlan | None = None):
        self.tokenizer, self.stops, self.think = tokenizer, stops, think
        self.tools = tools if tools is not None and tools.parses else None  # parse the reply's tool calls
        self.token_ids: list[int] = []
        self.reasoning = self.content = ""
        self.sent_reasoning = self.sent_content = 0
        self.finish_reason: str | None = None
        self.tool_calls: list[dict] = []  # OpenAI tool_calls, once done
        self.stats: dict = {}

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_ids: list[int], finish_reason: str | None) -> bool:
        """New state from the scheduler; True when a stop string ended the choice here."""
        self.token_ids = token_ids
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.reasoning, self.content = self._split(text)
        hits = [i for i in (self.content.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.content, self.finish_reason = self.content[: min(hits)], "stop"
        elif finish_reason:
            self.finish_reason = "stop" if finish_reason == "stop" else "length"
        if self.done and self.tools:
            content, self.tool_calls, self.finish_reason = self.tools.reply(self.content, self.finish_reason)
            self.content = content or ""
        return bool(hits)

    def message(self) -> dict:
        """The finished choice as a chat.completion message."""
        message = {"role": "assistant", "content": (self.content or None) if self.tool_calls else self.content}
        if self.think:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message

    def _split(self, text: str) -> tuple[str, str]:
        if not self.think:
            return "", text
        reasoning, answer, _ = split_partial(text)
        return reasoning, answer

    def deltas(self) -> tuple[str, str]:
        """(reasoning, content) not sent yet; while running, hold back what could be the start of a
        stop string or half a UTF-8 character."""
        reasoning, content = self.reasoning, self.content
        if not self.done:
            hold = max((len(s) for s in self.stops), default=1) - 1
            content = content[: len(content) - hold] if hold else content
            reasoning, content = reasoning.rstrip("\ufffd"), content.rstrip("\ufffd")
            if self.tools:  # tool calls are sent whole when the choice ends (app's stream)
                content = self.tools.streamable(content)
        r, c = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = max(self.sent_reasoning, len(reasoning)), max(self.sent_content, len(content))
        return r, c
