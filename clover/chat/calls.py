"""The tool-call frame of an assistant turn: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
one block per call (parallel calls one after another), written by `format_tool_call`, read back by
`parse_tool_calls` (and, while a reply streams, `text_before_call`). Calls get OpenAI-style ids
(`new_call_id`). `<tool_call>` and `</tool_call>` are atomic tokens in Clover's tokenizer."""

from __future__ import annotations

import json
import re
import uuid

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_FRAME = (CALL_OPEN, CALL_CLOSE)
CALL_HEAD = CALL_OPEN + '\n{"name": '  # what an infilled call starts with, before the JSON-quoted name
CALL_END = "}\n" + CALL_CLOSE  # ... and ends with, after its arguments
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


def new_call_id() -> str:
    """A fresh OpenAI-style tool-call id, `call_` + 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def function_spec(tool: dict) -> dict:
    """The function spec of an OpenAI tool ({"type": "function", "function": {...}}) or of a bare spec."""
    return tool.get("function", tool) if isinstance(tool, dict) else tool


def format_tool_call(call: dict) -> str:
    """One `<tool_call>` block; `call` is {"name", "arguments"} or OpenAI's {"function": {...}}
    (arguments as a dict or as the JSON string OpenAI clients send back)."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return CALL_OPEN + '\n{"name": "' + fn["name"] + '", "arguments": ' + args + "}\n" + CALL_CLOSE


def parse_tool_calls(text: str, tools: list | None = None) -> tuple[str, list[dict], list[str]]:
    """Generated text -> (content left, OpenAI tool_calls, problems).

    Each well-formed `<tool_call>` block (JSON with a string `name`, object `arguments`, and the name
    among `tools` when given) becomes {"id", "type": "function", "function": {"name", "arguments":
    JSON string}}. A malformed block stays in the content (never raises) and is listed in problems."""
    known = {function_spec(t)["name"] for t in tools} if tools else None
    calls, problems, kept, pos = [], [], [], 0
    for m in _CALL_RE.finditer(text):
        kept.append(text[pos:m.start()])
        pos = m.end()
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise ValueError("name must be a string and arguments an object")
            if known is not None and name not in known:
                raise ValueError(f"unknown function {name!r}")
        except (ValueError, KeyError, TypeError) as e:
            problems.append(f"malformed tool call: {e}")
            kept.append(m.group(0))
            continue
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    kept.append(text[pos:])
    content = "".join(kept)
    if content.count(CALL_OPEN) > content.count(CALL_CLOSE):
        problems.append("unterminated tool call")
    return content.strip(), calls, problems


def text_before_call(text: str) -> str:
    """Of a reply still being generated, the text that is surely no tool call: everything before the
    first `<tool_call>`, less a possible start of one at the end (`<tool_` may still become it)."""
    end = text.find(CALL_OPEN)
    if end < 0:
        end = len(text) - max((k for k in range(1, len(CALL_OPEN)) if text.endswith(CALL_OPEN[:k])), default=0)
    return text[:end]


def call_frame_ids(tokenizer, vocab_size: int | None = None) -> tuple[int, ...]:
    """Ids of the tool-call frame tokens this tokenizer has as single tokens (below the model's
    `vocab_size` when given): the tokens a reply may never generate when no tools are offered (the
    decoding's `SamplingParams.suppress`). A tokenizer that spells them as several pieces gets no mask
    (a piece like `<` is ordinary text)."""
    vocab = tokenizer.get_vocab()
    ids = (vocab[t] for t in CALL_FRAME if t in vocab)
    return tuple(sorted(i for i in ids if vocab_size is None or i < vocab_size))
