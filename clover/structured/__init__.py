"""Schema-guided structured output by infilling: a JSON schema's fixed text (keys, braces, quotes)
is laid out as known tokens and only the value slots are denoised, so the output is valid JSON for
the schema whatever the model. Normalisation, layout and the grammar path: docs/structured.md.

    out = clover.generate_json(model, tokenizer, "Ann is 34. As JSON:", {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}})
    out.value, out.valid, out.method, out.forward_passes
"""

from .generate import JsonResult, check_output, generate_json, infill_json, is_json_object
from .grammar import check_budget, check_grammar, grammar_json, smallest_document
from .result import BudgetTooSmall
from .normalize import Refused, normalize
from .schema import Skeleton, Unsupported, check, skeleton

__all__ = ["BudgetTooSmall", "JsonResult", "Refused", "Skeleton", "Unsupported", "check", "check_budget",
           "check_grammar", "check_output", "generate_json", "grammar_json", "infill_json", "is_json_object",
           "normalize", "skeleton", "smallest_document"]
