"""Schema-guided structured output by infilling: a JSON schema's fixed text (keys, braces, quotes)
is laid out as known tokens and only the value slots are denoised, so the output is valid JSON for
the schema whatever the model. Subset, layout and fallback: docs/structured.md.

    out = clover.generate_json(model, tokenizer, "Ann is 34. As JSON:", {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}})
    out.value, out.valid, out.method, out.forward_passes
"""

from .generate import JsonResult, check_output, generate_json, infill_json, is_json_object
from .schema import Skeleton, Unsupported, check, skeleton

__all__ = ["JsonResult", "Skeleton", "Unsupported", "check", "check_output", "generate_json", "infill_json",
           "is_json_object", "skeleton"]
