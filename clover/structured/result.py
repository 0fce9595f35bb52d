"""What a structured reply is (`JsonResult`) and the checks of its text against the schema, shared by
the infiller (generate.py) and the grammar path (grammar.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class JsonResult:
    text: str  # the JSON text (without prefix / suffix)
    value: object  # the parsed value; None when the text is not JSON
    valid: bool  # the value validates against the schema
    method: str  # "infill", "grammar" or "free"
    forward_passes: int  # model forwards after the prompt prefill
    seconds: float
    fallback_reason: str | None = None  # why the schema was not infilled
    error: str | None = None  # why the value is not valid
    token_ids: list[int] = field(default_factory=list)  # prefix + JSON + suffix (free: generated)
    complete: bool = True  # False: the token budget ran out before the document was complete
    note: str | None = None  # e.g. that the smallest valid document stands in for the model's tries

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "token_ids"}


class BudgetTooSmall(ValueError):
    """max_tokens cannot hold even the schema's smallest valid document (`need` tokens)."""

    keyword = "max_tokens"

    def __init__(self, need: int, budget: int):
        super().__init__(f"max_tokens ({budget}) is too small for any document valid under the schema: the "
                         f"smallest one needs {need} tokens")
        self.need, self.budget = need, budget


def is_json_object(schema) -> bool:
    """OpenAI's `response_format: {"type": "json_object"}`: any JSON object (not a JSON schema)."""
    return isinstance(schema, dict) and schema.get("type") == "json_object"


# ---- checks ----------------------------------------------------------------------------------------------
def validate(schema: dict, value) -> tuple[bool, str | None]:
    """(valid, the first error) of `value` under `schema`, `format` checked where jsonschema can."""
    from jsonschema import FormatChecker, validators

    if is_json_object(schema):
        return (True, None) if isinstance(value, dict) else (False, "not a JSON object")
    error = next(validators.validator_for(schema)(schema, format_checker=FormatChecker()).iter_errors(value), None)
    if error is None:
        return True, None
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return False, f"${where}: {error.message}"


def repair(schema: dict, value, text: str) -> tuple[object, str]:
    """`uniqueItems`, which the grammar does not enforce: repeated items dropped (the first kept)
    where minItems still holds; (value, text) unchanged when nothing was repeated."""
    from jsonschema import validators

    if is_json_object(schema):
        return value, text
    changed = False
    for _ in range(8):
        errors = [e for e in validators.validator_for(schema)(schema).iter_errors(value) if e.validator == "uniqueItems"]
        if not errors:
            break
        e = errors[0]
        items, kept = e.instance, []
        for item in items:
            if not any(json.dumps(item, sort_keys=True) == json.dumps(k, sort_keys=True) for k in kept):
                kept.append(item)
        if len(kept) < (e.schema.get("minItems", 0) if isinstance(e.schema, dict) else 0) or len(kept) == len(items):
            break
        items[:] = kept
        changed = True
    return value, (json.dumps(value, ensure_ascii=False) if changed else text)


def check_output(schema: dict, text: str) -> tuple[str, object, bool, str | None]:
    """(JSON text, value, valid, error) of generated text checked against `schema`: the text itself
    (stripped of surrounding whitespace) must be the document, not contain one."""
    text = text.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text, None, False, "the output is not JSON"
    valid, error = validate(schema, value)
    return text, value, valid, error
