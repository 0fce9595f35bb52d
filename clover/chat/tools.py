"""Tools offered to the model: OpenAI function specs (JSON-schema parameters) checked by
`validate_tools` and rendered into the system turn as one signature line each,
`name(a: integer, unit?: "km"|"mi") - description`, between <tools> tags: a small model with a short
context cannot afford a full JSON schema per tool."""

from __future__ import annotations

import json
import re

from .calls import function_spec

TOOLS_HEADER = "# Tools\n<tools>\n"  # the call format is learned from training dialogues, not spelled out
TOOLS_FOOTER = "</tools>"


class ToolSpecError(ValueError):
    """A client's `tools` entry is not a usable function spec."""


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
