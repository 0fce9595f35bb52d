"""Structured replies: OpenAI `response_format` (json_schema, json_object) and forced tool calls
(tool_choice "required" / a named function) by schema-guided infilling (`clover.structured`).

The JSON's fixed text (keys, braces, quotes, the call's `<tool_call>` frame) is laid out as known
tokens and only the values are denoised, so the reply is valid for its schema whatever the model,
in about one forward per value. Schemas outside the infilled subset (docs/structured.md) fall back
to free generation checked at the end; the response's `clover.structured` says which path ran and
whether the reply validates.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..structured import Skeleton, Unsupported, check_output, infill_json, skeleton
from .protocol import APIError, ToolPlan, forced_name

CALL_END = "}\n</tool_call>"


@dataclass
class FormatPlan:
    """A request's response_format: its schema ({"type": "json_object"} for json_object), the
    skeleton to infill, or None and the reason when it is generated freely and checked."""
    schema: dict
    skeleton: Skeleton | None
    reason: str | None = None


def format_plan(response_format) -> FormatPlan | None:
    """None for no / "text" format; APIError(400) for a malformed one or an invalid schema."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return FormatPlan({"type": "json_object"}, None, "json_object: any JSON object (no schema to lay out)")
    if kind != "json_schema":
        raise APIError(400, 'response_format.type must be "text", "json_object" or "json_schema"',
                       param="response_format")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                       param="response_format.json_schema.schema")
    try:
        return FormatPlan(schema, skeleton(schema))
    except Unsupported as e:
        return FormatPlan(schema, None, f"outside the infilled subset: {e}")
    except ValueError as e:
        raise APIError(400, f"response_format.json_schema.schema: {e}", param="response_format.json_schema.schema")


def check_reply(plan: FormatPlan, text: str) -> dict:
    """The fallback's verdict on a freely generated reply."""
    _, _, valid, error = check_output(plan.schema, text)
    return {"method": "fallback", "reason": plan.reason, "valid": valid} | ({"error": error} if error else {})


@dataclass
class Infilled:
    """An infilled reply: the content or one tool call, its tokens, forwards and the verdict."""
    content: str | None
    tool_calls: list[dict]
    completion_tokens: int
    info: dict


def infill_format(model, tokenizer, prompt_ids: list[int], plan: FormatPlan, threshold: float,
                  block_size: int) -> Infilled:
    r = infill_json(model, tokenizer, prompt_ids, plan.skeleton, threshold=threshold, block_size=block_size)
    return Infilled(r.text, [], len(r.token_ids), {"method": "infill", "valid": r.valid,
                                                   "forward_passes": r.forward_passes})


def _call_schemas(functions: list[dict]) -> dict[str, Skeleton] | None:
    """Each function's arguments skeleton; None when one is outside the subset."""
    try:
        return {f["name"]: skeleton(f.get("parameters") or {"type": "object", "properties": {}}) for f in functions}
    except (Unsupported, ValueError):
        return None


def infill_tool_call(model, tokenizer, prompt_ids: list[int], tools: ToolPlan, threshold: float,
                     block_size: int) -> Infilled | None:
    """A forced call: the function (an options slot over the names under "required" with several
    tools), then its arguments infilled from its parameters schema inside the fixed call frame.
    None when an arguments schema is outside the subset (the caller prefills and generates)."""
    schemas = _call_schemas(tools.functions)
    if schemas is None:
        return None
    name, forwards = forced_name(tools.choice, tools.functions), 0
    if name is None:
        pick = infill_json(model, tokenizer, prompt_ids, {"enum": list(schemas)}, prefix='<tool_call>\n{"name": ',
                           suffix=', "arguments":', threshold=threshold, block_size=block_size)
        name, forwards = pick.value, pick.forward_passes
    head = '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '
    r = infill_json(model, tokenizer, prompt_ids, schemas[name], prefix=head, suffix=CALL_END,
                    threshold=threshold, block_size=block_size)
    call = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": r.text}}
    return Infilled(None, [call], len(r.token_ids), {"method": "infill", "valid": r.valid,
                                                     "forward_passes": forwards + r.forward_passes})
