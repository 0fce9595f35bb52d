"""JSON schema (a subset) -> skeleton: the document's fixed text (scaffold) and its typed value slots.

A diffusion model need not write what the schema already fixes: keys, braces, commas and quotes are
laid out as known tokens and only the values are denoised (docs/structured.md). The document is
written as `json.dumps` writes it (", " and ": " separators), properties in schema order.

Supported subset (anything else raises `Unsupported`, and `generate_json` falls back to free
generation checked with `jsonschema`):

* `type: object` with `properties` (every property emitted but an optional one no value satisfies,
  nested objects allowed), `required` (a key `properties` does not declare is laid out as a string
  unless `additionalProperties` is false), `additionalProperties` true or false;
* `enum` / `const` (one options slot over the values' JSON texts; a single value is scaffold);
* `boolean` (true / false), `null` (scaffold);
* `integer` with `minimum` / `maximum` (and the exclusive forms): every value an option when there
  are at most 1,000, else a digit slot clamped to the bounds (unbounded: 6 digits and a sign);
* `number`: a digit slot with at most 2 decimals, clamped to the bounds;
* `string` with `minLength` / `maxLength` (characters): a free text slot that holds no quote,
  backslash or control character (the tokens that would write one are never chosen);
* `array` with one `items` schema and `maxItems` (at most 64): `minItems` items laid out, then one
  gate per optional item (continue with ", " or close the list here).

The result of `skeleton(schema)` does not depend on a tokenizer; `clover.structured.generate` turns
it into infill units.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

MAX_OPTIONS = 1000  # an integer range up to this size is one options slot
MAX_ITEMS = 64
ARRAY_CAP = 4  # items (beyond minItems, which may be more) of an array without maxItems
INTEGER_DIGITS = 6  # digits of an integer (or a number's integer part) without bounds
DECIMALS = 2  # decimals of a `number`
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions"}
KEYWORDS = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems", "uniqueItems"},
    "string": {"type", "minLength", "maxLength"},
    "integer": {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "boolean": {"type"},
    "null": {"type"},
}
ENUM_KEYWORDS = {"enum", "const"} | set().union(*KEYWORDS.values())  # the values are checked against them


class Unsupported(Exception):
    """A valid schema outside the subset that infilling lays out (the reason is the message)."""


# ---- skeleton parts --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Text:
    """Scaffold text. `closes`: the optional lists whose closing bracket starts this text."""

    text: str
    groups: frozenset = frozenset()
    closes: tuple = ()


@dataclass(frozen=True)
class Options:
    """One of these JSON texts (enum, const among several, boolean, a small integer range)."""

    options: tuple[str, ...]
    path: str
    groups: frozenset = frozenset()


@dataclass(frozen=True)
class String:
    """The characters between a string's quotes (the quotes are scaffold)."""

    min_length: int
    max_length: int | None
    path: str
    groups: frozenset = frozenset()


@dataclass(frozen=True)
class Number:
    """`sep` then a number with at most `decimals` decimals in [low, high] (decimals 0: an integer)."""

    sep: str
    low: Decimal
    high: Decimal
    decimals: int
    path: str
    groups: frozenset = frozenset()

    @property
    def width(self) -> int:
        """Characters of the longest allowed text (a bound on its tokens)."""
        digits = len(str(int(max(abs(self.low), abs(self.high)))))
        return len(self.sep) + (self.low < 0) + digits + (self.decimals + 1 if self.decimals else 0)


@dataclass(frozen=True)
class Gate:
    """Before optional item k of list `list_id`: continue with `separator` or close the list (the
    groups in `stop_groups`, item k and the later ones, are dropped)."""

    separator: str
    list_id: int
    stop_groups: frozenset
    path: str
    groups: frozenset = frozenset()


SLOTS = (Options, String, Number, Gate)


@dataclass
class Skeleton:
    schema: dict
    parts: list

    @property
    def slots(self) -> list:
        return [p for p in self.parts if isinstance(p, SLOTS)]

    def describe(self) -> str:
        """The layout as text: scaffold as written, each slot as ⟦...⟧."""
        out = []
        for p in self.parts:
            if isinstance(p, Text):
                out.append(p.text)
            elif isinstance(p, Options):
                shown = "|".join(p.options) if len(p.options) <= 4 else f"{p.options[0]}|...|{p.options[-1]}"
                out.append(f"⟦{shown}⟧")
            elif isinstance(p, String):
                out.append(f"⟦string {p.path}⟧")
            elif isinstance(p, Number):
                out.append(f"⟦{p.sep}{'integer' if p.decimals == 0 else 'number'} {p.low}..{p.high}⟧")
            else:
                out.append(f"⟦{p.separator!r} or close⟧")
        return "".join(out)


# ---- schema -> skeleton ------------------------------------------------------------------------------
_CHECKED: dict[str, str | None] = {}  # schema JSON -> why it is not a valid JSON schema (None: valid)


def check(schema) -> None:
    """ValueError unless `schema` is a valid JSON schema (an object). The verdict is kept per schema:
    checking a large one against its meta-schema is slow, and a request checks its schema more than
    once."""
    from jsonschema import SchemaError, validators

    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    key = json.dumps(schema, sort_keys=True, default=str)
    if key not in _CHECKED:
        if len(_CHECKED) > 256:
            _CHECKED.clear()
        try:
            validators.validator_for(schema).check_schema(schema)
            _CHECKED[key] = None
        except SchemaError as e:
            where = "/".join(map(str, e.path))
            _CHECKED[key] = f"not a valid JSON schema{f' at {where}' if where else ''}: {e.message}"
    if _CHECKED[key] is not None:
        raise ValueError(_CHECKED[key])


def skeleton(schema: dict) -> Skeleton:
    """The skeleton of `schema`: ValueError for an invalid or unsatisfiable schema, `Unsupported`
    for one outside the subset."""
    check(schema)
    builder = _Builder()
    builder.value(schema, "$", "", frozenset())
    return Skeleton(schema, builder.parts)


class _Builder:
    def __init__(self):
        self.parts: list = []
        self.lists = 0

    def text(self, text: str, groups: frozenset, closes: tuple = ()) -> None:
        last = self.parts[-1] if self.parts else None
        if isinstance(last, Text) and last.groups == groups:
            self.parts[-1] = Text(last.text + text, groups, last.closes + closes)
        else:
            self.parts.append(Text(text, groups, closes))

    def value(self, s, path: str, sep: str, groups: frozenset) -> None:
        """Lay out the value at `path`, written after `sep` (" " after ": " and ", ", "" after "[")."""
        if not isinstance(s, dict):
            raise Unsupported(f"{path}: a boolean schema ({json.dumps(s)})")
        kind = _kind(s, path)
        allowed = ENUM_KEYWORDS if "enum" in s or "const" in s else KEYWORDS.get(kind, set())
        extra = sorted(set(s) - allowed - ANNOTATIONS)
        if extra:
            raise Unsupported(f"{path}: {', '.join(map(repr, extra))} not supported")
        if "enum" in s or "const" in s:
            return self.choice(s, path, sep, groups)
        if kind is None:
            raise Unsupported(f"{path}: a schema without a type (any JSON value)")
        getattr(self, kind)(s, path, sep, groups)

    def choice(self, s, path, sep, groups) -> None:
        from jsonschema import validators

        rest = validators.validator_for(s)({k: v for k, v in s.items() if k != "enum"})  # const, type, bounds...
        values = [v for v in (s["enum"] if "enum" in s else [s["const"]]) if rest.is_valid(v)]
        if not values:
            raise ValueError(f"{path}: no enum value satisfies the schema")
        if len(values) == 1:
            return self.text(sep + _dumps(values[0]), groups)
        if all(isinstance(v, str) for v in values):  # the quotes are scaffold, as for free strings
            self.text(sep + '"', groups)
            self.parts.append(Options(tuple(_dumps(v)[1:-1] for v in values), path, groups))
            return self.text('"', groups)
        self.parts.append(Options(tuple(sep + _dumps(v) for v in values), path, groups))

    def object(self, s, path, sep, groups) -> None:
        props, required = dict(s.get("properties", {})), s.get("required", [])
        if not isinstance(s.get("additionalProperties", True), bool):
            raise Unsupported(f"{path}: additionalProperties as a schema")
        for key in [r for r in required if r not in props]:  # may take any value: laid out as a string
            if s.get("additionalProperties") is False:
                raise ValueError(f"{path}: required {key!r} is not in properties and additionalProperties is false")
            props[key] = {"type": "string"}
        self.text(sep + "{", groups)
        first = True
        for key, sub in props.items():
            saved = (list(self.parts), self.lists)
            self.text(("" if first else ", ") + _dumps(key) + ":", groups)
            try:
                self.value(sub, f"{path}.{key}", " ", groups)
            except ValueError:  # no value satisfies it: an optional property is left out
                if key in required:
                    raise
                self.parts, self.lists = saved
                continue
            first = False
        self.text("}", groups)

    def array(self, s, path, sep, groups) -> None:
        items, low, high = s.get("items"), s.get("minItems", 0), s.get("maxItems")
        if s.get("uniqueItems"):
            raise Unsupported(f"{path}: uniqueItems")
        if not isinstance(items, dict):
            raise Unsupported(f"{path}: an array needs one 'items' schema")
        if high is None:  # unbounded: the model decides up to a cap (gates)
            high = max(low, ARRAY_CAP)
        if low > high:
            raise ValueError(f"{path}: minItems {low} > maxItems {high}")
        if high > MAX_ITEMS:
            raise Unsupported(f"{path}: maxItems {high} > {MAX_ITEMS}")
        self.text(sep + "[", groups)
        for k in range(low):
            if k:
                self.text(",", groups)
            self.value(items, f"{path}[{k}]", " " if k else "", groups)
        if high == low:
            return self.text("]", groups)
        list_id, self.lists = self.lists, self.lists + 1
        optional = [(list_id, k) for k in range(low, high)]
        for k in range(low, high):
            inner = groups | {(list_id, k)}
            self.parts.append(Gate("," if k else "", list_id, frozenset(optional[k - low:]), f"{path}[{k}]", inner))
            self.value(items, f"{path}[{k}]", " " if k else "", inner)
        self.text("]", groups, closes=(list_id,))

    def string(self, s, path, sep, groups) -> None:
        low, high = s.get("minLength", 0), s.get("maxLength")
        if high is not None and low > high:
            raise ValueError(f"{path}: minLength {low} > maxLength {high}")
        self.text(sep + '"', groups)
        self.parts.append(String(low, high, path, groups))
        self.text('"', groups)

    def integer(self, s, path, sep, groups) -> None:
        low, high = _bounds(s, Decimal(1), path)
        if low is not None and high is not None and low > high:
            raise ValueError(f"{path}: no integer within the bounds")
        if low is not None and high is not None and high - low < MAX_OPTIONS:
            self.parts.append(Options(tuple(f"{sep}{v}" for v in range(int(low), int(high) + 1)), path, groups))
            return
        self.parts.append(Number(sep, *_fill(low, high), 0, path, groups))

    def number(self, s, path, sep, groups) -> None:
        step = Decimal(1).scaleb(-DECIMALS)
        low, high = _bounds(s, step, path)
        if low is not None and high is not None and low > high:
            raise Unsupported(f"{path}: no number of {DECIMALS} decimals within the bounds")
        self.parts.append(Number(sep, *_fill(low, high), DECIMALS, path, groups))

    def boolean(self, s, path, sep, groups) -> None:
        self.parts.append(Options((sep + "true", sep + "false"), path, groups))

    def null(self, s, path, sep, groups) -> None:
        self.text(sep + "null", groups)


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _kind(s: dict, path: str) -> str | None:
    kind = s.get("type")
    if isinstance(kind, list):
        if len(kind) != 1:
            raise Unsupported(f"{path}: a list of types ({', '.join(kind)})")
        kind = kind[0]
    if kind is None:
        kind = "object" if "properties" in s else "array" if "items" in s else None
    return kind


def _bounds(s: dict, step: Decimal, path: str) -> tuple[Decimal | None, Decimal | None]:
    """The smallest and largest multiples of `step` the bounds allow (None: unbounded)."""
    def bound(key):
        value = s.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Unsupported(f"{path}: {key} {value!r} (draft-4 style bounds)")
        return Decimal(str(value)) / step

    found = [(bound("minimum"), ROUND_CEILING, 0), (bound("exclusiveMinimum"), ROUND_FLOOR, 1),
             (bound("maximum"), ROUND_FLOOR, 0), (bound("exclusiveMaximum"), ROUND_CEILING, -1)]
    grid = [None if b is None else (b.to_integral_value(rounding) + shift) * step for b, rounding, shift in found]
    lows, highs = [g for g in grid[:2] if g is not None], [g for g in grid[2:] if g is not None]
    return max(lows, default=None), min(highs, default=None)


def _fill(low: Decimal | None, high: Decimal | None) -> tuple[Decimal, Decimal]:
    """Unbounded sides get INTEGER_DIGITS digits of room."""
    room = Decimal(10 ** INTEGER_DIGITS - 1)
    if low is None:
        low = min(high if high is not None else Decimal(0), Decimal(0)) - room
    if high is None:
        high = max(low, Decimal(0)) + room
    return low, high

