"""The text of one choice as it streams: decoding, the thinking split, stop strings, tool calls, and
what may be sent yet."""

from __future__ import annotations

import json
import weakref

from ..chat import split_partial
from .protocol import ToolPlan

# tokenizer -> whether `Text` may go on from a prefix
_BYTE_LEVEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoding of ids a + b is decode(a) + decode(b) wherever decode(a) ends in a
    whole character: a fast tokenizer whose decoder is ByteLevel alone (each token is bytes; the text is
    their UTF-8) with no clean-up pass after it (which looks across the cut), and whose decode is the fast
    tokenizer's own (not a wrapper's or a subclass's)."""
    try:
        return _BYTE_LEVEL[tokenizer]
    except (KeyError, TypeError):
        pass
    from transformers import PreTrainedTokenizerFast

    own = isinstance(tokenizer, PreTrainedTokenizerFast) and all(
        getattr(type(tokenizer), f) is getattr(PreTrainedTokenizerFast, f) for f in ("decode", "_decode"))
    backend = tokenizer.backend_tokenizer if own else None
    try:
        spec = json.loads(backend.to_str()) if backend is not None else {}
    except Exception:  # noqa: BLE001 - a backend that cannot say: the whole decode every time
        spec = {}
    decoder = spec.get("decoder") or {}
    cleans = getattr(tokenizer, "clean_up_tokenization_spaces", True) and not (
        (spec.get("model") or {}).get("type") == "BPE"
        and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    ok = decoder.get("type") == "ByteLevel" and not cleans
    try:
        _BYTE_LEVEL[tokenizer] = ok
    except TypeError:
        pass
    return ok


class Text:
    """The text of a choice's growing token ids (special tokens skipped), as `tokenizer.decode` gives it.
    With a `byte_level` tokenizer only the ids after the last cut at a whole character are decoded
    (the settled prefix's text is kept); otherwise, or when the ids do not start with that prefix,
    all of them (`plain`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer if byte_level(tokenizer) else None
        self.ids: list[int] = []  # the settled prefix
        self.text = ""  # its text

    def plain(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __call__(self, ids: list[int]) -> str:
        if self.backend is None:
            return self.plain(ids)
        k = len(self.ids)
        if len(ids) < k or ids[:k] != self.ids:
            k, self.ids, self.text = 0, [], ""
        text = self.text + self.backend.decode(ids[k:], skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # a whole last character: the next cut may be here
            self.ids, self.text = list(ids), text
        return text


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
        self.text = Text(tokenizer)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_ids: list[int], finish_reason: str | None) -> bool:
        """New state from the scheduler; True when a stop string ended the choice here."""
        self.token_ids = token_ids
        text = self.text(token_ids)
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
