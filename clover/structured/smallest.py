"""The smallest document of a schema: what the grammar path returns when the model's tries did not
end within max_tokens (or were all rejected by the final check), and what a request is refused by
before decoding when even it cannot fit (a 400 naming the tokens it needs).

`smallest_text(decodable, schema)` builds a short value from a decodable schema (for_decoding's output at
the grammar path's tightest caps): required keys only (optional ones where minProperties asks),
minItems items, minLength characters, the number nearest 0 within the bounds, the shortest enum
value, the shortest anyOf branch, a pattern's shortest match (`pattern_min`). It is returned only when
it validates against `schema` (the normalised schema), else None: never an invalid document.
"""

from __future__ import annotations

import json
import math
import re

_NONE = object()  # no value could be built
_MEMO = "\x00smallest"  # the key, in a copy of $defs, of the definitions already built
DEPTH = 32  # $ref expansions on one path
FORMAT_SAMPLES = {"date": "2000-01-01", "time": "00:00:00Z", "date-time": "2000-01-01T00:00:00Z",
                  "uuid": "00000000-0000-0000-0000-000000000000", "ipv4": "0.0.0.0", "ipv6": "::1",
                  "email": "a@b.co", "uri": "http://a.co", "hostname": "a"}


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _shortest(candidates):
    found = [c for c in candidates if c is not _NONE]
    return min(found, key=lambda v: len(_dumps(v))) if found else _NONE


def smallest_text(decodable, schema) -> str | None:
    """The smallest document of `decodable` that `schema` accepts, as JSON text (the separators the
    grammar path writes), or None (see the module docstring)."""
    from .result import validate

    try:
        value = _value(decodable, dict(decodable.get("$defs", {}) if isinstance(decodable, dict) else {}), 0)
    except RecursionError:
        return None
    if value is _NONE or not validate(schema, value)[0]:
        return None
    return _dumps(value)


def _value(s, defs: dict, depth: int):
    if s is True or s == {}:
        return 0
    if not isinstance(s, dict) or depth > DEPTH:
        return _NONE
    if "$ref" in s:  # each definition built once (a recursion through it: nothing, another branch wins)
        name = s["$ref"].rsplit("/", 1)[-1] if isinstance(s["$ref"], str) else None
        memo = defs.setdefault(_MEMO, {}) if isinstance(defs, dict) else {}
        if name not in defs or name == _MEMO:
            return _NONE
        if name not in memo:
            memo[name] = _NONE
            memo[name] = _value(defs[name], defs, depth + 1)
        return memo[name]
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return _shortest(list(s["enum"]))
    branches = [b for k in ("anyOf", "oneOf") for b in s.get(k, [])]
    if branches:
        return _shortest(_value(b, defs, depth + 1) for b in branches)
    types = s.get("type")
    types = [types] if isinstance(types, str) else types or [_implied(s)]
    return _shortest(_typed(t, s, defs, depth) for t in types)


def _implied(s: dict) -> str | None:
    for keys, kind in ((("properties", "required", "additionalProperties", "patternProperties"), "object"),
                       (("items", "prefixItems", "minItems"), "array"), (("minLength", "pattern", "format"), "string"),
                       (("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), "number")):
        if any(k in s for k in keys):
            return kind
    return None


def _typed(kind, s: dict, defs: dict, depth: int):
    if kind is None:
        return 0
    if kind == "null":
        return None
    if kind == "boolean":
        return True
    if kind in ("integer", "number"):
        return _number(s, kind == "integer")
    if kind == "string":
        return _string(s)
    if kind == "array":
        return _array(s, defs, depth)
    if kind == "object":
        return _object(s, defs, depth)
    return _NONE


def _number(s: dict, integer: bool):
    """0 when the bounds allow it, else the multiple (of multipleOf, or 1) nearest 0 within them, else
    (a number) the middle of the bounds."""
    bound = {k: s[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
             if isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool)}
    step = s.get("multipleOf", 1) if isinstance(s.get("multipleOf"), (int, float)) else 1

    def ok(v) -> bool:
        return (bound.get("minimum", -math.inf) <= v <= bound.get("maximum", math.inf)
                and bound.get("exclusiveMinimum", -math.inf) < v < bound.get("exclusiveMaximum", math.inf))

    low = max(bound.get("minimum", -math.inf), bound.get("exclusiveMinimum", -math.inf))
    high = min(bound.get("maximum", math.inf), bound.get("exclusiveMaximum", math.inf))
    candidates = [0]
    if low > 0 and math.isfinite(low):
        candidates += [math.ceil(low / step) * step, (math.floor(low / step) + 1) * step]
    if high < 0 and math.isfinite(high):
        candidates += [math.floor(high / step) * step, (math.ceil(high / step) - 1) * step]
    if not integer and math.isfinite(low) and math.isfinite(high):
        candidates.append((low + high) / 2)
    for v in candidates:
        if ok(v) and (not integer or float(v).is_integer()):
            return int(v) if float(v).is_integer() else v
    return _NONE


def _string(s: dict):
    need = s.get("minLength", 0)
    if isinstance(s.get("pattern"), str):
        text = pattern_min(s["pattern"])
        if text is None:
            return _NONE
        return text if len(text) >= need else _NONE
    if isinstance(s.get("format"), str):
        return FORMAT_SAMPLES.get(s["format"], _NONE)
    return "a" * need


def _array(s: dict, defs: dict, depth: int):
    prefix = [_value(p, defs, depth + 1) for p in s.get("prefixItems", [])]
    need = max(s.get("minItems", 0), 0)
    out = prefix[:max(need, 0)] if need <= len(prefix) else prefix
    if any(v is _NONE for v in out):
        return _NONE
    if len(out) < need:
        items = s.get("items", True)
        if items is False:
            return _NONE
        item = _value(items, defs, depth + 1)
        if item is _NONE:
            return _NONE
        out += [item] * (need - len(out))
    return out


def _object(s: dict, defs: dict, depth: int):
    props = s.get("properties", {})
    out = {}
    for key in s.get("required", []):
        sub = props.get(key, s.get("additionalProperties", True))
        out[key] = _value(sub if sub is not None else True, defs, depth + 1)
        if out[key] is _NONE:
            return _NONE
    for key, sub in props.items():  # optional ones minProperties still asks for
        if len(out) >= s.get("minProperties", 0):
            break
        if key not in out:
            value = _value(sub, defs, depth + 1)
            if value is not _NONE:
                out[key] = value
    return out if len(out) >= s.get("minProperties", 0) else _NONE


# ---- patterns ------------------------------------------------------------------------------------------------
_CANDIDATES = "a0A_-. b1x/:@z"


def pattern_min(pattern: str) -> str | None:
    """A shortest string the regular expression matches as it is laid out (repeats at their minimum,
    the shortest alternative, a class's first candidate character), checked with `re.search`; None
    when that string does not match (lookarounds, back references)."""
    import re._parser as sre

    try:
        text = _sub(sre.parse(pattern))
    except (re.error, _Give, RecursionError, OverflowError):
        return None
    return text if re.search(pattern, text) is not None else None


class _Give(Exception):
    pass


def _sub(items) -> str:
    return "".join(_node(op, av) for op, av in items)


def _node(op, av) -> str:
    import re._constants as c

    if op is c.LITERAL:
        return chr(av)
    if op is c.NOT_LITERAL:
        return next(ch for ch in _CANDIDATES if ord(ch) != av)
    if op is c.ANY:
        return "a"
    if op is c.IN:
        return _klass(av)
    if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
        low, _, sub = av
        return _sub(sub) * low if low else ""
    if op is c.SUBPATTERN:
        return _sub(av[-1])
    if op is c.BRANCH:
        found = []
        for branch in av[1]:
            try:
                found.append(_sub(branch))
            except _Give:
                continue
        if not found:
            raise _Give()
        return min(found, key=len)
    if op in (c.AT, c.ASSERT, c.ASSERT_NOT):
        return ""
    if op is getattr(c, "ATOMIC_GROUP", None):
        return _sub(av)
    raise _Give()


def _klass(items) -> str:
    import re._compiler as rc
    import re._parser as sre

    matcher = rc.compile(sre.SubPattern(sre.State(), [(sre.IN, items)]))
    for ch in _CANDIDATES + "".join(map(chr, range(0x21, 0x300))) + "\t\n\r":
        if matcher.fullmatch(ch):
            return ch
    raise _Give()
