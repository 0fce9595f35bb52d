"""How tools, tool calls and tool results look in a Clover prompt (the Qwen3 convention, compact).

* Tools (OpenAI function specs with JSON-schema parameters) are rendered into the system turn as one
  signature line each, `name(a: integer, unit?: "km"|"mi") - description`, between <tools> tags:
  a small model with a short context cannot afford a full JSON schema per tool.
* An assistant tool call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several
  calls one per line block (parallel calls).
* Tool results go back as a user turn of `<tool_response>\\n...\\n</tool_response>` blocks, one per
  consecutive `tool` message.
* Assistant turns whose content does not open a <think> block get the empty one, exactly what the
  non-thinking generation prompt writes, so history looks like what the model itself produced.

`normalize_messages` turns OpenAI-style messages (+ tools) into plain {role, content} turns; the
Jinja chat template in `clover.data.tokenizer` does the same (tested equal), so training data,
`apply_chat_template` and the server agree token for token. `parse_tool_calls` is the inverse for
generated text.
"""

from __future__ import annotations

import json
import re
import uuid

EMPTY_THINK = "<think>\n\n</think>\n\n"
TOOLS_HEADER = "# Tools\n<tools>\n"  # the call format is learned from training dialogues, not spelled out
TOOLS_FOOTER = "</tools>"
_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class ToolSpecError(ValueError):
    """A client's `tools` entry is not a usable function spec."""


def function_spec(tool: dict) -> dict:
    """The function spec of an OpenAI tool ({"type": "function", "function": {...}}) or of a bare spec."""
    return tool.get("function", tool) if isinstance(tool, dict) else tool


def validate_tools(tools: list) -> list[dict]:
    """Checks the OpenAI `tools` list; returns the function specs. Raises ToolSpecError naming the fault."""
    if not isinstance(tools, list):
        raise ToolSpecError("tools must be a list")
    out, names = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ToolSpecError(f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} tools are supported")
        fn = function_spec(t)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", name):
            raise ToolSpecError(f"tools[{i}]: function.name must be an identifier (got {name!r})")
        if name in names:
            raise ToolSpecError(f"tools[{i}]: duplicate function name {name!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object" \
                or not isinstance(params.get("properties", {}), dict):
            raise ToolSpecError(f"tools[{i}] ({name}): parameters must be a JSON schema of type object")
        names.add(name)
        out.append(fn)
    return out


def _type_str(schema: dict) -> str:
    if "enum" in schema:
        return "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    return str(schema.get("type") or "any")


def tool_signature(tool: dict) -> str:
    """`name(a: integer, unit?: "km"|"mi") - description` (`?` = optional)."""
    fn = function_spec(tool)
    params = fn.get("parameters") or {}
    req = params.get("required") or []
    args = ", ".join(f"{k}{'' if k in req else '?'}: {_type_str(v)}" for k, v in (params.get("properties") or {}).items())
    desc = fn.get("description")
    return f"{fn['name']}({args})" + (f" - {desc}" if desc else "")


def render_tools(tools: list) -> str:
    return TOOLS_HEADER + "".join(tool_signature(t) + "\n" for t in tools) + TOOLS_FOOTER


def format_tool_call(call: dict) -> str:
    """One `<tool_call>` block; `call` is {"name", "arguments"} or OpenAI's {"function": {...}}
    (arguments as a dict or as the JSON string OpenAI clients send back)."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return '<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + args + "}\n</tool_call>"


def normalize_messages(messages: list[dict], tools: list | None = None) -> list[dict]:
    """OpenAI-style messages (+ tools) -> plain [{"role", "content"}] turns as the template renders them."""
    out: list[dict] = []
    msgs = list(messages)
    if tools:
        sys_text = render_tools(tools)
        if msgs and msgs[0].get("role") == "system":
            sys_text = (msgs[0].get("content") or "") + "\n\n" + sys_text
            msgs = msgs[1:]
        out.append({"role": "system", "content": sys_text})
    for m in msgs:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = "<tool_response>\n" + content + "\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        if role == "assistant":
            calls = "\n".join(format_tool_call(c) for c in m.get("tool_calls") or [])
            content = content + ("\n" if content and calls else "") + calls
            if not content.startswith("<think>"):
                content = EMPTY_THINK + content
        out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


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
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    kept.append(text[pos:])
    content = "".join(kept)
    if content.count("<tool_call>") > content.count("</tool_call>"):
        problems.append("unterminated tool call")
    return content.strip(), calls, problems


CALL_FRAME = ("<tool_call>", "</tool_call>")  # atomic tokens in Clover's tokenizer (clover.data.tokenizer)


def call_frame_ids(tokenizer, vocab_size: int | None = None) -> tuple[int, ...]:
    """Ids of the tool-call frame tokens this tokenizer has as single tokens (below the model's
    `vocab_size` when given): the tokens a reply may never generate when no tools are offered (the
    decoding's `SamplingParams.suppress`). A tokenizer that spells them as several pieces gets no mask
    (a piece like `<` is ordinary text)."""
    vocab = tokenizer.get_vocab()
    ids = (vocab[t] for t in CALL_FRAME if t in vocab)
    return tuple(sorted(i for i in ids if vocab_size is None or i < vocab_size))
