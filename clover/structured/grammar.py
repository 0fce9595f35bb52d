"""The grammar path: JSON for any schema the infiller cannot lay out, decoded left to right (the
engine's `ar` mode) under a token mask from xgrammar, so the output can only be a document the
schema's grammar accepts; it is then checked with `jsonschema` all the same (docs/structured.md,
"Grammar path").

xgrammar (PyPI, CPU) was picked over llguidance: its token masks are far cheaper on the default
tokenizer, and llguidance cannot read the character-level test tokenizer's decoder.

The schema is first normalised (`normalize`) and strengthened for decoding (`for_decoding`: bounded
strings and arrays, strict objects); the keywords xgrammar does not enforce are either met that way,
repaired after decoding (`uniqueItems`: repeated items dropped while minItems allows), caught by the
final check, or refused beforehand (`Refused`, a 400 in the server).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass

import torch

from ..engine.infill import decode_constrained_task, per_tokenizer, token_ids, vocab_mask
from ..engine.sampling import Draw
from ..engine.slots import drive
from .compiler import IN_PROCESS_CHARS, CompileError, CompileTimeout, compile_in_worker, compile_options
from .normalize import STRING_CAP, Refused, bounded_work, for_decoding, unroll
from .result import BudgetTooSmall, JsonResult, is_json_object, repair, validate
from .smallest import smallest_text

# OpenAI's json_object (any object), bounded for decoding; numbers within +-NUMBER_BOUND, so none is
# written with an exponent that overflows a float to inf (`8888E88888`)
NUMBER_BOUND = 1e15
JSON_OBJECT = {"type": "object", "maxProperties": 4, "propertyNames": {"maxLength": 16},
               "additionalProperties": {"type": ["string", "integer", "number", "boolean", "null"], "maxLength": 24,
                                        "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND}}
TRIES = 4  # decodings of one request when the final check rejects a document


@dataclass(frozen=True)
class Caps:
    """How far the grammar path lets one document grow beyond what its schema requires (on top of
    `for_decoding`'s STRING_CAP / ARRAY_CAP, never below minLength / minItems / required):
    `string` characters of a free string, `items` items of an array (and entries of a map) past its
    minimum, `optional` whether properties the schema does not require may be written at all."""
    string: int
    items: int
    optional: bool = True


# the ladder a document climbs down when its budget runs out: None is for_decoding's own caps
LADDER: tuple[Caps | None, ...] = (None, Caps(string=8, items=1), Caps(string=0, items=0, optional=False))
GRAMMAR_CHARS = 2_000_000  # the largest decodable schema (JSON characters) compiled; past it: Refused
CHARS_PER_TOKEN = 2  # the worst case a level's estimated size may reach per token of budget to start there
COMPILE_SECONDS = 20.0  # one request's grammar compiles, all ladder levels together; past it: Refused
LEVEL_SECONDS = 5.0  # of which a level above the tightest may take (a tighter one compiles faster)
_COMPILERS: dict[int, tuple] = {}  # id(tokenizer) -> (tokenizer, compiler, (vocab, stops), TokenizerInfo)
_GRAMMARS: dict[tuple[int, str], object] = {}  # (id(compiler), schema JSON) -> compiled grammar
_SLOW: dict[tuple[int, str], float] = {}  # (id(compiler), schema JSON) -> the seconds its compile outran
_DECODABLE: dict[str, object] = {}  # normalised schema JSON -> decodable (caps-free)


def _compiler(tokenizer, vocab_size: int, stops: tuple[int, ...]):
    """(xgrammar GrammarCompiler, its TokenizerInfo) of a tokenizer, kept."""
    import xgrammar as xgr

    entry = _COMPILERS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer or entry[2] != (vocab_size, stops):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stops))
        entry = _COMPILERS[id(tokenizer)] = (tokenizer, xgr.GrammarCompiler(info, max_threads=1), (vocab_size, stops),
                                             info)
    return entry[1], entry[3]


def decodable(schema, caps: Caps | None = None):
    """What the grammar gets for a normalised schema: conditionals as cases (`conditionals`), made
    decodable (`for_decoding`), patterns xgrammar reads right (`safe_patterns`), then held within
    `caps` (`tighten`). The caps-free form is kept per schema (the ladder's levels start from it);
    `Refused` past GRAMMAR_CHARS."""
    key = json.dumps(schema, sort_keys=True)
    if key not in _DECODABLE:
        if len(_DECODABLE) > 256:
            _DECODABLE.clear()
        try:
            _DECODABLE[key] = _decodable(schema)
        except Refused as e:  # kept too: a refusal can take seconds to reach (MAX_NODES)
            _DECODABLE[key] = e
    out = _DECODABLE[key]
    if isinstance(out, Refused):
        raise out
    return out if caps is None else tighten(out, caps)


def _decodable(schema):
    try:
        with bounded_work():
            out = JSON_OBJECT if is_json_object(schema) else safe_patterns(for_decoding(unroll(conditionals(schema))))
    except RecursionError:  # e.g. a meta-schema's mutually recursive vocabularies, expanded
        raise Refused("$ref", "#", "nested too deeply for the grammar path") from None
    chars = len(json.dumps(out))
    if chars > GRAMMAR_CHARS:  # renovate's config expands to ~20 MB: compiling it would take minutes
        raise Refused("schema", "#", f"its grammar would be {chars / 1e6:.0f} MB of schema, more than the "
                      f"grammar path compiles ({GRAMMAR_CHARS / 1e6:.0f} MB)")
    return out


def compile_schema(tokenizer, vocab_size: int, stops: tuple[int, ...], schema, caps: Caps | None = None,
                   seconds: float | None = None) -> object:
    """The compiled grammar of a normalised schema (cached) within `caps`; `Refused` for what it
    cannot enforce or xgrammar cannot compile, `CompileTimeout` when compiling takes more than
    `seconds` (a large schema compiles in the worker process, clover.structured.compiler)."""
    seconds = COMPILE_SECONDS if seconds is None else seconds
    decodable_ = decodable(schema, caps)
    compiler, info = _compiler(tokenizer, vocab_size, tuple(stops))
    key = (id(compiler), json.dumps(decodable_, sort_keys=True))
    if _SLOW.get(key, 0.0) >= seconds:  # it did not compile in as much time before: not tried again
        raise CompileTimeout()
    if key not in _GRAMMARS:
        try:
            if len(key[1]) <= IN_PROCESS_CHARS:
                _GRAMMARS[key] = compiler.compile_json_schema(key[1], **compile_options())
            else:
                _GRAMMARS[key] = compile_in_worker((id(compiler), vocab_size, tuple(stops)), info, key[1], seconds)
        except CompileTimeout:
            _SLOW[key] = max(_SLOW.get(key, 0.0), seconds)
            raise
        except (CompileError, RuntimeError, ValueError) as e:  # xgrammar's reason
            reason = clean_message(str(e))
            raise Refused(_keyword(reason), "#", f"the grammar library cannot compile it: {reason}") from None
    return _GRAMMARS[key]


def clean_message(message: str) -> str:
    """xgrammar's error without its log prefix (time, C++ source file and line): the first line, cut."""
    line = (message.strip().splitlines() or [""])[0]
    line = re.sub(r"^\[[\d:]+\]\s*", "", line)
    line = re.sub(r"\S*[/\\]\S+\.(?:cc|cpp|cxx|h|hpp|py):\d+:\s*", "", line)
    return line[:200]


def _keyword(message: str) -> str:
    for word in ("maxProperties", "minProperties", "maxItems", "minItems", "pattern", "format", "$ref", "multipleOf",
                 "patternProperties", "propertyNames", "anyOf", "oneOf", "enum", "required"):
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


def _stops(model, tokenizer) -> tuple[int, ...]:
    from ..settings import eos_ids

    stops = tuple(eos_ids(model, tokenizer))
    if not stops:
        raise ValueError("the tokenizer and model define no EOS token (needed after the JSON)")
    return stops


def _too_slow(seconds: float) -> Refused:
    return Refused("schema", "#", f"its grammar did not compile within the grammar path's {seconds:g} s "
                   "(a smaller schema: fewer maps, arrays or alternatives, or tighter maxItems / maxProperties)")


def check_grammar(model, tokenizer, schema, seconds: float | None = None) -> None:
    """`Refused` unless the grammar path can decode the (normalised) schema: its tightest level (the
    cheapest grammar) compiled within `seconds` (COMPILE_SECONDS)."""
    seconds = COMPILE_SECONDS if seconds is None else seconds
    try:
        compile_schema(tokenizer, model.config.vocab_size, _stops(model, tokenizer), schema, LADDER[-1], seconds)
    except CompileTimeout:
        raise _too_slow(seconds) from None


_SMALLEST: dict = {}  # per tokenizer (infill.per_tokenizer): (schema JSON, prefix, suffix) -> the answer


def smallest_document(tokenizer, schema, prefix: str = "", suffix: str = "") -> tuple[str, list[int]] | None:
    """(text, token ids with prefix and suffix) of the schema's smallest valid document (smallest.py),
    or None when none could be built (or the schema is refused). Kept per tokenizer, schema and frame
    (every forced call of a tool asks again)."""
    kept = per_tokenizer(_SMALLEST, tokenizer)
    key = (json.dumps(schema, sort_keys=True, default=repr), prefix, suffix)
    if key not in kept:
        kept[key] = _smallest_document(tokenizer, schema, prefix, suffix)
    hit = kept[key]
    return None if hit is None else (hit[0], list(hit[1]))


def _smallest_document(tokenizer, schema, prefix: str, suffix: str) -> tuple[str, list[int]] | None:
    try:
        tight = JSON_OBJECT if is_json_object(schema) else decodable(schema, LADDER[-1])
    except Refused:
        return None
    text = smallest_text(tight, schema)
    if text is None:
        return None
    return text, (token_ids(tokenizer, prefix) if prefix else []) + token_ids(tokenizer, text) + (
        token_ids(tokenizer, suffix) if suffix else [])


def check_budget(tokenizer, schema, max_new_tokens: int, prefix: str = "", suffix: str = "") -> None:
    """BudgetTooSmall when even the schema's smallest valid document (with prefix and suffix) does
    not fit `max_new_tokens`."""
    smallest = smallest_document(tokenizer, schema, prefix, suffix)
    if smallest is not None and len(smallest[1]) > max_new_tokens:
        raise BudgetTooSmall(len(smallest[1]), max_new_tokens)


def grammar_json(model, tokenizer, prompt_ids: list[int], schema, prefix: str = "", suffix: str = "",
                 max_new_tokens: int = 256, tries: int = TRIES, threshold: float | None = None,
                 block_size: int | None = None, draw: Draw | None = None):
    """Decode the JSON of `schema` (normalised) after `prompt_ids` and the fixed text `prefix`, then `suffix`; a
    JsonResult with method "grammar". BudgetTooSmall first when even the smallest valid document cannot fit
    `max_new_tokens`. The caps start at the first LADDER level whose documents fit the budget by estimate
    (`start_level`); a level whose grammar does not compile within its share of COMPILE_SECONDS is skipped for
    a tighter one (Refused when the tightest does not); a try that `max_new_tokens` cuts is decoded again one
    level tighter, and a document the final check rejects (a keyword the grammar does not enforce) again
    sampled, up to `tries` such times (the forwards of every try are counted). The first try is greedy, unless
    `draw` samples them all. When no try gave a valid document, the smallest one is returned (`note` says so);
    `complete` is False only when none could be built and the tightest level ran out. A public family decodes
    in its own blocks of `block_size` at `threshold` (None: the family's published ones;
    engine/family_grammar.py); Clover's left-to-right decoding ignores them. `grammar_json_task`: the same as
    a task (engine/slots.py)."""
    return drive(grammar_json_task(model, tokenizer, prompt_ids, schema, prefix, suffix, max_new_tokens, tries,
                                   threshold, block_size, draw=draw))


def grammar_json_task(model, tokenizer, prompt_ids: list[int], schema, prefix: str = "", suffix: str = "",
                      max_new_tokens: int = 256, tries: int = TRIES, threshold: float | None = None,
                      block_size: int | None = None, watch=None, draw: Draw | None = None):
    """`grammar_json` as a task; `watch`, when given, is handed a function that reads the text a try
    has decoded so far (for a stream) as the try starts: the first try, when max_tokens cannot cut it.
    `draw` (engine/sampling.Draw): every try sampled with its params and generator among the tokens
    the grammar allows, the first one too (None: greedy first, then at temperature 1)."""
    start = time.perf_counter()
    check_budget(tokenizer, schema, max_new_tokens, prefix, suffix)
    level = start_level(schema, max_new_tokens)
    deadline = time.monotonic() + COMPILE_SECONDS
    out, forwards, rejected = None, 0, 0
    while True:
        try:
            grammar = _level_grammar(model, tokenizer, schema, level, deadline)
        except CompileTimeout:
            if level == len(LADDER) - 1:
                raise _too_slow(COMPILE_SECONDS) from None
            level += 1
            continue
        generator = draw.generator if draw else None if rejected == 0 else torch.Generator().manual_seed(rejected)
        out = yield from _decode_task(model, tokenizer, prompt_ids, schema, prefix, suffix, max_new_tokens,
                                      generator, grammar, (threshold, block_size),
                                      watch if rejected == 0 and _uncut(schema, level, prefix, suffix, max_new_tokens)
                                      else None, draw.params if draw else None)
        forwards += out.forward_passes
        if out.valid:
            break
        if not out.complete:
            if level == len(LADDER) - 1:
                break
            level += 1
            continue
        rejected += 1
        if rejected >= tries:
            break
    if not out.valid:
        out = _smallest_result(tokenizer, schema, prefix, suffix, max_new_tokens, out)
    out.forward_passes, out.seconds = forwards, time.perf_counter() - start
    return out


def _uncut(schema, level: int, prefix: str, suffix: str, max_new_tokens: int) -> bool:
    """Whether a try of this LADDER level can be streamed as it decodes: max_tokens can never cut it (its
    largest size in characters, a token being at least one, and the frame fit) and nothing after the try
    can reject or rewrite it (`exact`)."""
    if not exact(schema):
        return False
    return size(decodable(schema, LADDER[level])) + len(prefix) + len(suffix) <= max_new_tokens


# keywords whose constraint the grammar (and the infill layout) meets exactly: a document decoded under
# them always passes the final check unchanged. Any other (a string `format` or `pattern`, `multipleOf`,
# `uniqueItems`'s repair, a `oneOf` the grammar reads as anyOf, ...) may make the check reject a try or
# `repair` rewrite it, and a redone try cannot extend text a stream already sent.
EXACT = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
         "enum", "const", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
         "anyOf", "$ref", "$defs"}
_SUBSCHEMA_MAPS, _SUBSCHEMA_LISTS, _SUBSCHEMA = ("properties", "$defs"), ("prefixItems", "anyOf"), (
    "additionalProperties", "items")


def exact(schema) -> bool:
    """Whether every document the grammar path (or the infiller) can give for this normalised schema
    passes the final check as it was decoded: only then may a stream send a try's text before it is
    accepted (`EXACT`)."""
    if is_json_object(schema) or isinstance(schema, bool):
        return True
    if not isinstance(schema, dict) or set(schema) - EXACT:
        return False
    subs = [schema.get(k) for k in _SUBSCHEMA if k in schema]
    subs += [v for k in _SUBSCHEMA_MAPS for v in (schema.get(k) or {}).values()]
    subs += [v for k in _SUBSCHEMA_LISTS for v in (schema.get(k) or [])]
    return all(exact(v) for v in subs)


def _level_grammar(model, tokenizer, schema, level: int, deadline: float):
    """The compiled grammar of one LADDER level within what is left of the request's compile time (a
    level above the tightest: at most LEVEL_SECONDS of it)."""
    left = max(deadline - time.monotonic(), 0.0)
    seconds = left if level == len(LADDER) - 1 else min(left, LEVEL_SECONDS)
    if seconds <= 0:
        raise CompileTimeout()
    return compile_schema(tokenizer, model.config.vocab_size, _stops(model, tokenizer), schema, LADDER[level], seconds)


def _smallest_result(tokenizer, schema, prefix, suffix, max_new_tokens, out: JsonResult) -> JsonResult:
    """The smallest valid document in place of a last try that was cut or rejected (kept when none fits)."""
    smallest = smallest_document(tokenizer, schema, prefix, suffix)
    if smallest is None or len(smallest[1]) > max_new_tokens:
        return out
    text, ids = smallest
    why = "cut by max_tokens" if not out.complete else f"rejected by the final check ({out.error})"
    return JsonResult(text, json.loads(text), True, "grammar", 0, 0.0, None, None, ids,
                      note=f"the smallest valid document: the model's last try was {why}")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} overflows to infinity")
    return value


def finite_loads(text: str):
    """json.loads, where a number that a float reads as infinity (`8888E88888`) is a ValueError: no
    JSON encoder writes it back (json.dumps gives `Infinity`, which is not JSON)."""
    return json.loads(text, parse_float=_finite)


def _decode(model, tokenizer, prompt_ids, schema, prefix, suffix, max_new_tokens, generator, grammar):
    """One try of `grammar_json` under a compiled grammar, alone."""
    return drive(_decode_task(model, tokenizer, prompt_ids, schema, prefix, suffix, max_new_tokens, generator,
                              grammar))


def _decode_task(model, tokenizer, prompt_ids, schema, prefix, suffix, max_new_tokens, generator, grammar,
                 blocks=(None, None), watch=None, params=None):
    import xgrammar as xgr

    start = time.perf_counter()
    stops = _stops(model, tokenizer)
    vocab = model.config.vocab_size
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    head = token_ids(tokenizer, prefix) if prefix else []
    # never a control character (xgrammar lets some through inside strings) nor a special or added token
    banned = ~vocab_mask(tokenizer, vocab, "json text", lambda t: not any(ord(c) < 0x20 for c in t))
    banned[list(stops)] = False

    def allow(logits: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        logits[:, banned.to(logits.device)] = float("-inf")

    seen: list[int] = []  # the tokens accepted so far, read by `watch`'s function

    def accept(t: int) -> bool:
        ok = matcher.accept_token(t) and not matcher.is_terminated()
        if ok and watch is not None:
            seen.append(t)
        return ok

    if watch is not None:
        watch(lambda: tokenizer.decode(seen[:], skip_special_tokens=True, clean_up_tokenization_spaces=False))

    tail = token_ids(tokenizer, suffix) if suffix else []
    budget = max_new_tokens - len(head) - len(tail)  # the fixed prefix and suffix count against max_tokens too
    tokens, complete, forwards = yield from decode_constrained_task(
        model, list(prompt_ids) + head, allow, accept, set(stops), budget, generator,
        _closers(tokenizer, stops), budget // 4, *blocks, params)
    text = tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    tail = tail if complete else []
    if not complete:
        return JsonResult(text, None, False, "grammar", forwards, time.perf_counter() - start, None,
                          f"max_tokens ({max_new_tokens}) ran out before the JSON was complete",
                          head + tokens, complete=False)
    try:
        value = finite_loads(text)
    except ValueError as e:  # json.JSONDecodeError too
        return JsonResult(text, None, False, "grammar", forwards, time.perf_counter() - start, None,
                          f"not JSON: {e}", head + tokens + tail)
    repaired, fixed = repair(schema, value, text)
    if fixed != text:
        text, value, tokens = fixed, repaired, token_ids(tokenizer, fixed)
    valid, error = validate(schema, value)
    return JsonResult(text, value, valid, "grammar", forwards, time.perf_counter() - start, None, error,
                      head + tokens + tail)


# ---- caps: documents that end within the budget ------------------------------------------------------------
_FREE_STRING = ("pattern", "format", "enum", "const")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def tighten(schema, caps: Caps):
    """A decodable schema (for_decoding's output) held within `caps`: every document it accepts is
    one the input accepts (bounds only lowered to the schema's own minimums, optional properties left
    out only where no other key may stand in for them), so the meaning is kept and the output stays
    valid. `not` is left as it is (a bound lowered inside it would widen what it allows)."""
    if not isinstance(schema, dict):
        return schema
    s = _children(schema, lambda v: tighten(v, caps), ("items", "additionalProperties"))
    if isinstance(s.get("propertyNames"), dict):  # map keys: short, yet room for distinct ones
        s["propertyNames"] = tighten(s["propertyNames"], Caps(max(caps.string, 4), caps.items, caps.optional))
    if isinstance(s.get("maxLength"), int) and not any(k in s for k in _FREE_STRING):
        s["maxLength"] = max(s.get("minLength", 0), min(s["maxLength"], caps.string))
    if isinstance(s.get("maxItems"), int):
        floor = max(s.get("minItems", 0), len(s.get("prefixItems", [])))
        s["maxItems"] = max(floor, min(s["maxItems"], floor + caps.items))
    required = [k for k in s.get("required", []) if k in s.get("properties", {})]
    is_map = isinstance(s.get("additionalProperties"), dict) or s.get("additionalProperties") is True \
        or "patternProperties" in s
    if isinstance(s.get("maxProperties"), int):
        floor = max(s.get("minProperties", 0), len(s.get("required", [])))
        s["maxProperties"] = max(floor, min(s["maxProperties"], floor + caps.items))
    if is_map and s.get("maxProperties") == len(required) == len(set(s.get("required", []))) and not any(
            re.search(p, k) for p in s.get("patternProperties", {}) for k in required):
        # no room for a key beyond the required ones: the map's parts go (its grammar is the costly part)
        for key in ("patternProperties", "propertyNames"):
            s.pop(key, None)
        s["additionalProperties"], is_map = False, False
    if not caps.optional and isinstance(s.get("properties"), dict) and not is_map:
        room = max(s.get("minProperties", 0) - len(required), 0)  # optional ones minProperties still asks for
        optional = [k for k in s["properties"] if k not in required][:room]
        s["properties"] = {k: v for k, v in s["properties"].items() if k in required or k in optional}
    return s


def size(schema, defs: dict | None = None, active: frozenset = frozenset(), memo: dict | None = None) -> float:
    """An estimate from above of the characters of the longest document a decodable schema accepts
    (strings counted at up to 2 characters a character, for escapes); inf when unbounded (a `$ref`
    that recurses included). Each subschema is measured once (memo), so this is linear in its size."""
    inf = float("inf")
    if schema is True:
        return inf
    if not isinstance(schema, dict) or schema is False:
        return 0
    memo = {} if memo is None else memo
    key = id(schema)
    if key not in memo:
        memo[key] = (schema, _size(schema, schema.get("$defs", {}) if defs is None else defs, active, memo))
    return memo[key][1]


def _size(s: dict, defs: dict, active: frozenset, memo: dict) -> float:
    inf = float("inf")

    def size_(x, refs=active):
        return size(x, defs, refs, memo)
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1] if isinstance(s["$ref"], str) else None
        if name in active or name not in defs:
            return inf
        return size(defs[name], defs, active | {name}, {})  # not memoised across $ref chains: active differs
    if "const" in s:
        return len(json.dumps(s["const"]))
    if "enum" in s:
        return max((len(json.dumps(v)) for v in s["enum"]), default=0)
    branches = [b for k in ("anyOf", "oneOf") for b in s.get(k, [])]
    if branches:
        return max(size_(b) for b in branches)
    types = s.get("type")
    types = [types] if isinstance(types, str) else types
    if not types:
        return inf
    out = 0.0
    for t in types:
        if t == "string":
            n = s.get("maxLength", 2 * STRING_CAP if ("pattern" in s or "format" in s) else inf)
            out = max(out, 2 * n + 2)
        elif t in ("integer", "number"):
            digits = max(len(str(int(abs(s.get(k, 0))))) for k in ("minimum", "maximum", "exclusiveMinimum",
                                                                     "exclusiveMaximum"))
            out = max(out, digits + 1 + (7 if t == "number" else 0))
        elif t in ("boolean", "null"):
            out = max(out, 5)
        elif t == "array":
            items = s.get("items", {}) if s.get("items") is not False else False
            prefix = s.get("prefixItems", [])
            extra = max(s.get("maxItems", inf) - len(prefix), 0)
            out = max(out, 2 + sum(size_(p) + 1 for p in prefix)
                      + (extra * (size_(items) + 1) if extra else 0))
        elif t == "object":
            props = s.get("properties", {})
            total = 2 + sum(len(json.dumps(k)) + 2 + size_(v) for k, v in props.items())
            extra = s.get("additionalProperties")
            if isinstance(extra, dict) or extra is True or "patternProperties" in s:
                key = s.get("propertyNames", {}).get("maxLength", inf) if isinstance(s.get("propertyNames"), dict) else inf
                value = max([size_(extra) if extra is not None else 0]
                            + [size_(v) for v in s.get("patternProperties", {}).values()])
                room = max(s.get("maxProperties", inf), 0)
                total += room * (2 * key + 4 + value) if room else 0
            out = max(out, total)
        else:
            return inf
    return out


def start_level(schema, max_new_tokens: int) -> int:
    """The first LADDER level whose documents' estimated size fits CHARS_PER_TOKEN * max_new_tokens
    (the last one when none does)."""
    for i, caps in enumerate(LADDER):
        if size(decodable(schema, caps)) <= CHARS_PER_TOKEN * max_new_tokens:
            return i
    return len(LADDER) - 1


# ---- rewrites for what xgrammar gets wrong -------------------------------------------------------------
def _children(s: dict, f, singles=("items", "additionalProperties", "propertyNames", "then", "else")) -> dict:
    """`s` with f applied to each subschema (not inside `not`/`if`, where a strengthening widens):
    those of _SUBSCHEMA_MAPS, _SUBSCHEMA_LISTS and the keywords `singles`."""
    s = dict(s)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(s.get(key), dict):
            s[key] = {k: f(v) for k, v in s[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(s.get(key), list):
            s[key] = [f(v) for v in s[key]]
    for key in singles:
        if isinstance(s.get(key), dict):
            s[key] = f(s[key])
    return s


def _condition(part) -> tuple[str, object] | None:
    """(P, v) of an allOf part `{"if": {"properties": {P: {"const": v}}[, "required": [P]]}, "then": T}`."""
    if not isinstance(part, dict) or set(part) != {"if", "then"} or not isinstance(part["if"], dict):
        return None
    cond = part["if"]
    props = cond.get("properties")
    if set(cond) - {"properties", "required"} or not isinstance(props, dict) or len(props) != 1:
        return None
    (name, value), = props.items()
    if not isinstance(value, dict) or set(value) != {"const"} or cond.get("required", [name]) != [name]:
        return None
    return name, value["const"]


def conditionals(schema):
    """A normalised schema with each allOf of if/then parts keyed on one property's const (GitHub's
    issue forms: `if type is "markdown" then attributes.value ...`, one part per type) written as an
    anyOf of the cases, each with the property set to its value and that case's `then`: every
    document of a case is valid (the other conditions fail on the value), so this strengthens the
    schema only by leaving out the values no condition names. for_decoding, which makes every `if` of
    an allOf hold at once, must otherwise drop them all when they conflict (the final check then
    rejected most documents)."""
    if not isinstance(schema, dict):
        return schema
    s = _children(schema, conditionals)
    parts = s.get("allOf")
    if not isinstance(parts, list):
        return s
    keyed = [(i, _condition(p)) for i, p in enumerate(parts)]
    keyed = [(i, c) for i, c in keyed if c is not None]
    names = {c[0] for _, c in keyed}
    values = [json.dumps(c[1], sort_keys=True) for _, c in keyed]
    if len(keyed) < 2 or len(names) != 1 or len(set(values)) != len(values):
        return s
    (name,) = names
    cases = [{"allOf": [{"properties": {name: {"const": v}}, "required": [name]}, parts[i]["then"]]}
             for i, (_, v) in keyed]
    rest = [p for i, p in enumerate(parts) if i not in {j for j, _ in keyed}]
    s["allOf"] = rest + [{"anyOf": cases}]
    return s


def _optional_groups(pattern: str) -> str:
    """`(...)?` written `(...){0,1}` (the same regex): xgrammar 0.2 compiles an optional group with a
    repeat inside wrongly (`^b(@.{1,2})?$` accepts "bx", and SchemaStore's GitHub workflow `uses`
    pattern `...\\.(ya?ml)(@.+)?$` accepted "x/y.ymlo.gl")."""
    out, escaped, klass, closed = [], False, False, False
    for c in pattern:
        after_group, closed = closed, False
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif klass:
            klass = c != "]"
        elif c == "[":
            klass = True
        elif c == ")":
            closed = True
        elif c == "?" and after_group:
            c = "{0,1}"
        out.append(c)
    return "".join(out)


def safe_patterns(schema):
    """A decodable schema with its patterns (and patternProperties keys) as `_optional_groups` writes them."""
    if not isinstance(schema, dict):
        return schema
    s = _children(schema, safe_patterns)
    if isinstance(s.get("pattern"), str):
        s["pattern"] = _optional_groups(s["pattern"])
    if isinstance(s.get("patternProperties"), dict):
        s["patternProperties"] = {_optional_groups(k): v for k, v in s["patternProperties"].items()}
    return s
