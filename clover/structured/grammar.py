"""The grammar path: JSON for any schema the infiller cannot lay out, decoded left to right (the
engine's `ar` mode) under a token mask from xgrammar, so the output can only be a document the
schema's grammar accepts; it is then checked with `jsonschema` all the same (docs/structured.md,
"Grammar path").

xgrammar (PyPI, CPU) was picked over llguidance by a measurement on the default tokenizer: a mask
took ~0.06 ms with xgrammar and ~190 ms with llguidance, which also cannot read the character-level
test tokenizer's decoder.

The schema is first normalised (`normalize`) and strengthened for decoding (`for_decoding`: bounded
strings and arrays, strict objects); the keywords xgrammar does not enforce are either met that way,
repaired after decoding (`uniqueItems`: repeated items dropped while minItems allows), caught by the
final check, or refused beforehand (`Refused`, a 400 in the server).
"""

from __future__ import annotations

import json
import re
import time

import torch

from ..engine.infill import decode_constrained, token_ids, vocab_mask
from .normalize import Refused, for_decoding, unroll
from .result import JsonResult, is_json_object, repair, validate

# OpenAI's json_object (any object), bounded for decoding
JSON_OBJECT = {"type": "object", "maxProperties": 4, "propertyNames": {"maxLength": 16},
               "additionalProperties": {"type": ["string", "integer", "number", "boolean", "null"], "maxLength": 24}}
TRIES = 4  # decodings of one request when the final check rejects a document
_COMPILERS: dict[int, tuple[object, object, tuple]] = {}  # id(tokenizer) -> (tokenizer, compiler, stop ids)
_GRAMMARS: dict[tuple[int, str], object] = {}  # (id(compiler), schema JSON) -> compiled grammar


def _compiler(tokenizer, vocab_size: int, stops: tuple[int, ...]):
    import xgrammar as xgr

    entry = _COMPILERS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer or entry[2] != (vocab_size, stops):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stops))
        entry = _COMPILERS[id(tokenizer)] = (tokenizer, xgr.GrammarCompiler(info, max_threads=1), (vocab_size, stops))
    return entry[1]


def compile_schema(tokenizer, vocab_size: int, stops: tuple[int, ...], schema) -> object:
    """The compiled grammar of a normalised schema (cached); `Refused` for what it cannot enforce or
    xgrammar cannot compile."""

    try:
        decodable = JSON_OBJECT if is_json_object(schema) else for_decoding(unroll(schema))
    except RecursionError:  # e.g. a meta-schema's mutually recursive vocabularies, expanded
        raise Refused("$ref", "#", "nested too deeply for the grammar path") from None
    compiler = _compiler(tokenizer, vocab_size, tuple(stops))
    key = (id(compiler), json.dumps(decodable, sort_keys=True))
    if key not in _GRAMMARS:
        try:
            _GRAMMARS[key] = compiler.compile_json_schema(key[1], any_whitespace=False, strict_mode=True)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its reason
            raise Refused(_keyword(str(e)), "#", f"the grammar library cannot compile it: {str(e).splitlines()[0][:200]}")
    return _GRAMMARS[key]


def _keyword(message: str) -> str:
    for word in ("pattern", "format", "$ref", "multipleOf", "patternProperties", "propertyNames", "anyOf", "oneOf"):
        if word in message:
            return word
    return "schema"


def _closers(tokenizer, stops):
    """closers(tokens) for the wrap-up: inside a string its closing quote first, else EOS and the
    closing brackets (then the quote: an empty string, and a zero or false, end a value soonest)."""
    def one(text):
        ids = token_ids(tokenizer, text)
        return ids if len(ids) == 1 else []

    outside = list(stops) + one("}") + one("]") + one('"') + one("0") + one(" 0") + one("false")
    inside = one('"') + outside

    def closers(tokens: list[int]) -> list[int]:
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        quotes = len(re.findall(r'(?<!\\)(?:\\\\)*"', text))
        return inside if quotes % 2 else outside
    return closers


def check_grammar(model, tokenizer, schema) -> None:
    """`Refused` unless the grammar path can decode the (normalised) schema."""
    from ..api import eos_ids

    compile_schema(tokenizer, model.config.vocab_size, eos_ids(model, tokenizer), schema)


def grammar_json(model, tokenizer, prompt_ids: list[int], schema, prefix: str = "", suffix: str = "",
                 max_new_tokens: int = 256, tries: int = TRIES):
    """Decode the JSON of `schema` (normalised) after `prompt_ids` and the fixed text `prefix`, then
    `suffix`; a JsonResult with method "grammar". The first try is greedy; a document the final
    check rejects (a keyword the grammar does not enforce) is decoded again, sampled, up to `tries`
    times in all (the forwards of every try are counted). `complete` is False when max_new_tokens ran
    out first: the text is then the truncated document, never valid."""
    start = time.perf_counter()
    out, forwards = None, 0
    for k in range(tries):
        generator = None if k == 0 else torch.Generator().manual_seed(k)
        out = _decode(model, tokenizer, prompt_ids, schema, prefix, suffix, max_new_tokens, generator)
        forwards += out.forward_passes
        if out.valid or not out.complete:
            break
    out.forward_passes, out.seconds = forwards, time.perf_counter() - start
    return out


def _decode(model, tokenizer, prompt_ids, schema, prefix, suffix, max_new_tokens, generator):
    import xgrammar as xgr

    from ..api import eos_ids

    start = time.perf_counter()
    stops = eos_ids(model, tokenizer)
    if not stops:
        raise ValueError("the tokenizer and model define no EOS token (needed after the JSON)")
    vocab = model.config.vocab_size
    matcher = xgr.GrammarMatcher(compile_schema(tokenizer, vocab, stops, schema))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    head = token_ids(tokenizer, prefix) if prefix else []
    # never a control character (xgrammar lets some through inside strings) nor a special or added token
    banned = ~vocab_mask(tokenizer, vocab, "json text", lambda t: not any(ord(c) < 0x20 for c in t))
    banned[list(stops)] = False

    def allow(logits: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        logits[:, banned.to(logits.device)] = float("-inf")

    def accept(t: int) -> bool:
        return matcher.accept_token(t) and not matcher.is_terminated()

    tokens, complete, forwards = decode_constrained(model, list(prompt_ids) + head, allow, accept, set(stops),
                                                    max_new_tokens, generator, _closers(tokenizer, stops),
                                                    max_new_tokens // 4)
    text = tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    tail = token_ids(tokenizer, suffix) if suffix and complete else []
    if not complete:
        return JsonResult(text, None, False, "grammar", forwards, time.perf_counter() - start, None,
                          f"max_tokens ({max_new_tokens}) ran out before the JSON was complete",
                          head + tokens, complete=False)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return JsonResult(text, None, False, "grammar", forwards, time.perf_counter() - start, None,
                          f"not JSON: {e}", head + tokens + tail)
    repaired, fixed = repair(schema, value, text)
    if fixed != text:
        text, value, tokens = fixed, repaired, token_ids(tokenizer, fixed)
    valid, error = validate(schema, value)
    return JsonResult(text, value, valid, "grammar", forwards, time.perf_counter() - start, None, error,
                      head + tokens + tail)
