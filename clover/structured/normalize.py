"""Schema normalisation: a real-world JSON schema -> the same constraints in the form the infiller and
the grammar path read (docs/structured.md, "Normalisation").

`normalize(schema)` is meaning-preserving: every document valid under the result is valid under the
input as Clover reads it, and the other way round:

* annotation and unknown keywords are dropped (title, description, examples, draft-04 `id`,
  `readonly`, `x-*` vendor keys, `discriminator`, ...): validators ignore them;
* local `$ref` (`#`, `#/definitions/...`, `#/$defs/...`, any JSON pointer into the document) is
  inlined; a recursive one becomes a `$ref` into the result's own `$defs` (the grammar path expands
  it); `$ref` siblings apply with it (as in draft 2019-09 and later);
* draft-04 boolean `exclusiveMinimum` / `exclusiveMaximum` become the numeric forms, draft-04 array
  `items` becomes `prefixItems` (+ `additionalItems` as `items`), `dependencies` splits into
  `dependentRequired` / `dependentSchemas`;
* `nullable: true` (OpenAPI 3.0) allows null, as OpenAPI means it;
* `format` stays where it constrains (`FORMATS`: date, date-time, uuid, email, ipv4, ...) and is
  dropped where it does not (`float`, `int64`, `password`, ...: annotations);
* `allOf` is merged into one schema where the parts combine (properties, required, bounds, types);
* a `oneOf` whose branches cannot overlap (different types, or distinct const / enum values of a
  required property) is an `anyOf`.

`Refused` (a ValueError naming the keyword and its path) is what nothing in Clover can honour:
a remote `$ref` (other than to a bundled JSON Schema meta-schema), a dynamic reference in a resource
with embedded resources, an `allOf` that does not merge. `for_decoding(schema)` then makes
a normalised schema decodable by the grammar path (bounded, strict) or refuses it.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from contextlib import contextmanager
from urllib.parse import urldefrag, urljoin

# the validation vocabulary (draft 2020-12, with draft-04..07 spellings normalised away)
VALIDATION = {
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "propertyNames", "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems",
    "uniqueItems", "contains", "minContains", "maxContains", "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf",
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "unevaluatedProperties",
    "unevaluatedItems", "$ref", "$defs",
}
# formats that constrain a string (checked by the grammar and, where jsonschema can, by its checker)
FORMATS = {"date", "date-time", "time", "email", "uuid", "ipv4", "ipv6", "uri", "hostname"}
INLINE_LIMIT = 4000  # characters of a normalised $ref target inlined at each use
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONE = ("additionalProperties", "propertyNames", "items", "contains", "not", "if", "then", "else",
              "unevaluatedProperties", "unevaluatedItems")


class Refused(ValueError):
    """A schema nothing in Clover can honour: `keyword` at `path` (a JSON pointer into the schema)."""

    def __init__(self, keyword: str, path: str, why: str = "not supported"):
        super().__init__(f"{keyword!r} at {path or '#'}: {why}")
        self.keyword, self.path = keyword, path or "#"


class TooDeep(Refused):
    """A recursion for_decoding bounds (`_entered`)."""


class TooLarge(Refused):
    """A schema for_decoding stops expanding (MAX_NODES): never left out as an optional part."""


MAX_NODES = 100_000  # subschemas one for_decoding may lay out (the largest SchemaStore CI schema: ~15,000)
_WORK = threading.local()


@contextmanager
def bounded_work():
    """for_decoding calls inside count against MAX_NODES (TooLarge past it): a schema whose $refs
    expand without end (renovate's config: hundreds of MB) is refused in seconds, not compiled for
    minutes."""
    _WORK.nodes = 0
    try:
        yield
    finally:
        _WORK.nodes = None


def _count_node() -> None:
    nodes = getattr(_WORK, "nodes", None)
    if nodes is None:
        return
    _WORK.nodes = nodes + 1
    if nodes + 1 > MAX_NODES:
        raise TooLarge("schema", "#", f"it expands to more than {MAX_NODES} subschemas for the grammar path "
                       "(its $refs nest too widely)")


def normalize(schema, root: dict | None = None) -> dict | bool:
    """The normalised schema (see the module docstring); `Refused` for what cannot be honoured.
    `root`: the document local `$ref`s point into (default: the schema itself), e.g. an OpenAPI
    document for `{"$ref": "#/components/schemas/Pet"}`."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    n = _Normalizer(schema if root is None else root)
    out = n.node(schema, "#", ())
    if n.defs:
        if not isinstance(out, dict):
            out = {"allOf": [out]} if out is not True else {}
        out = dict(out)
        out["$defs"] = n.defs
    return out


def _base(doc) -> str:
    """A document's base URI: its `$id` (draft-04 `id`) without the fragment, or "" (none)."""
    if isinstance(doc, dict):
        for key in ("$id", "id"):
            if isinstance(doc.get(key), str) and not doc[key].startswith("#"):
                return urldefrag(doc[key])[0]
    return ""


def _bundled_uri(uri: str) -> str:
    """The URI a JSON Schema meta-schema is bundled under (json-schema.org's drafts 3 to 7 are
    published at http URIs; https is the same document)."""
    if uri.startswith("https://json-schema.org/draft-0"):
        return "http://" + uri[len("https://"):]
    return uri


def meta_schema(uri: str):
    """The JSON Schema meta-schema (or vocabulary meta-schema) at `uri` (drafts 3 to 2020-12), from the
    copies jsonschema-specifications bundles, or None: references to them resolve offline."""
    from jsonschema_specifications import REGISTRY

    try:
        return REGISTRY.contents(_bundled_uri(urldefrag(uri)[0]))
    except Exception:  # referencing.exceptions.NoSuchResource: not bundled
        return None


_MISSING = object()


def _follow(doc, pointer: str):
    """The node a JSON pointer ("/a/0/b", `_escape`d parts) names in `doc`, or _MISSING."""
    target = doc
    for part in [p for p in pointer.split("/") if p != ""]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return _MISSING
    return target


class _Normalizer:
    """Walks one document. `scope`: the resources (base URI, document) entered by `$ref`s above the
    node being normalised, outermost first (the root, then e.g. a bundled meta-schema): relative
    references resolve against the innermost, dynamic ones (`$dynamicRef`, `$recursiveRef`) against
    the outermost that declares the anchor, as the 2019-09 / 2020-12 specifications say."""

    def __init__(self, root: dict):
        self.root = root
        self.scope: list[tuple[str, object]] = [(_base(root), root)]
        self.defs: dict[str, object] = {}  # recursive targets, normalised, by name
        self.names: dict[str, str] = {}  # key -> name in defs
        self.done: dict[str, object] = {}  # key -> its normalised target

    def locate(self, ref, path: str, keyword: str = "$ref") -> tuple[str, object, tuple]:
        """(key, target, resource) of a reference: a JSON pointer or anchor into the current resource,
        the root, or a JSON Schema meta-schema bundled with jsonschema-specifications (offline: nothing
        is fetched); any other remote reference is Refused. `key`: the absolute reference ("#..." for
        the root), what recursion and reuse are told by."""
        if not isinstance(ref, str):
            raise Refused(keyword, path, f"a reference must be a string, got {ref!r}")
        base, doc = self.scope[-1]
        uri, fragment = urldefrag(urljoin(base, ref) if base else ref)
        if uri in ("", base):
            resource = (base, doc)
        elif uri == self.scope[0][0]:
            resource = self.scope[0]
        else:
            bundled = meta_schema(uri)
            if bundled is None:
                raise Refused(keyword, path, "only local references (#/...) and the JSON Schema meta-schemas are "
                              f"supported, got {ref!r}")
            resource = (_bundled_uri(uri), bundled)
        pointer = fragment
        if fragment and not fragment.startswith("/"):  # a plain-name fragment: an $anchor
            pointer = self._anchor(resource[1], fragment, "", ("$anchor", "$dynamicAnchor"))
            if pointer is None:
                raise Refused(keyword, path, f"no anchor {fragment!r} in {resource[0] or 'this document'}")
        target = _follow(resource[1], pointer)
        if target is _MISSING:
            raise Refused(keyword, path, f"{ref!r} does not resolve in {resource[0] or 'this document'}")
        key = ("" if resource[1] is self.root else resource[0]) + "#" + pointer
        return key, target, resource

    def dynamic(self, key: str, ref, path: str) -> tuple[str, object, tuple]:
        """A `$recursiveRef` / `$dynamicRef` located: first as a plain reference; when that lands on a
        `$recursiveAnchor: true` resource root / a `$dynamicAnchor` of the fragment's name, the
        outermost resource of the scope that declares the same anchor instead. A resource with an
        embedded resource (`$id` below its root) is refused: its scope is not tracked."""
        if self._embedded(self.scope[-1][1], top=True):
            raise Refused(key, path, "in a document with embedded resources ($id below the root)")
        if key == "$recursiveRef" and ref != "#":
            raise Refused(key, path, f"only '#' is defined, got {ref!r}")
        found = self.locate(ref, path, key)
        target = found[1]
        if key == "$recursiveRef":
            if not (isinstance(target, dict) and target.get("$recursiveAnchor") is True):
                return found
            for base, doc in self.scope:
                if isinstance(doc, dict) and doc.get("$recursiveAnchor") is True:
                    return ("" if doc is self.root else base) + "#", doc, (base, doc)
            return found
        name = urldefrag(ref)[1]
        if "/" in name or name == "" or not (isinstance(target, dict) and target.get("$dynamicAnchor") == name):
            return found  # a JSON pointer, or a plain anchor: a plain $ref
        for base, doc in self.scope:
            pointer = self._anchor(doc, name, "", ("$dynamicAnchor",))
            if pointer is not None:
                return ("" if doc is self.root else base) + "#" + pointer, _follow(doc, pointer), (base, doc)
        return found

    def _embedded(self, s, top: bool = False) -> bool:
        if isinstance(s, dict):
            if not top and isinstance(s.get("$id"), str) and not s["$id"].startswith("#"):
                return True
            return any(self._embedded(v) for k, v in s.items() if k not in ("enum", "const", "examples", "default"))
        if isinstance(s, list):
            return any(self._embedded(v) for v in s)
        return False

    def _anchor(self, s, name: str, pointer: str, keys: tuple) -> str | None:
        """The JSON pointer of the subschema with an anchor `name` (one of `keys`), or None."""
        if isinstance(s, dict):
            if any(s.get(k) == name for k in keys):
                return pointer
            items = [(k, v) for k, v in s.items() if k not in ("enum", "const", "examples", "default")]
        elif isinstance(s, list):
            items = list(enumerate(s))
        else:
            return None
        for k, v in items:
            found = self._anchor(v, name, f"{pointer}/{_escape(str(k))}", keys)
            if found is not None:
                return found
        return None

    def node(self, s, path: str, stack: tuple):
        """One schema node, normalised. `stack`: the refs being inlined above it (recursion check)."""
        if isinstance(s, bool):
            return s
        if not isinstance(s, dict):
            raise ValueError(f"{path}: a schema must be an object or a boolean, got {type(s).__name__}")
        s = dict(s)
        parts = []
        for key in ("$dynamicRef", "$recursiveRef"):
            if key in s:
                parts.append(self.ref(self.dynamic(key, s.pop(key), path), path, stack))
        if "$ref" in s:
            parts.append(self.ref(self.locate(s.pop("$ref"), path), path, stack))
        out = self.own(s, path, stack)
        if not parts:
            return out
        parts += [] if out == {} or out is True else [out]
        return parts[0] if len(parts) == 1 else _merged(parts, path)

    def ref(self, located: tuple, path: str, stack: tuple):
        """The normalised target of a located reference: inlined, or a `$ref` into the result's
        `$defs` when it is recursive or large (INLINE_LIMIT characters: a target used in many places
        would otherwise be copied into each)."""
        key = located[0]
        if key in stack or key in self.names:
            return {"$ref": "#/$defs/" + self._recursive(located, path, stack)}
        if key not in self.done:
            self.done[key] = self._inside(located, path, stack)
            if key in self.names:  # it turned out recursive while it was built
                return {"$ref": "#/$defs/" + self.names[key]}
            if len(json.dumps(self.done[key])) > INLINE_LIMIT:
                self.names[key] = self._name(key)
                self.defs[self.names[key]] = self.done[key]
                return {"$ref": "#/$defs/" + self.names[key]}
        return copy.deepcopy(self.done[key])

    def _inside(self, located: tuple, path: str, stack: tuple):
        """The target normalised within its resource (pushed on the scope while it is)."""
        key, target, resource = located
        self.scope.append(resource)
        try:
            return self.node(target, f"{path}/$ref", stack + (key,))
        finally:
            self.scope.pop()

    def _name(self, key: str) -> str:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", key.rstrip("#").rsplit("/", 1)[-1].strip("#")) or "root"
        while name in self.defs or name in self.names.values():
            name += "_"
        return name

    def _recursive(self, located: tuple, path: str, stack: tuple) -> str:
        key = located[0]
        if key not in self.names:
            self.names[key] = name = self._name(key)
            self.defs[name] = True  # placeholder while it is built
            self.defs[name] = self._inside(located, path, stack)
        return self.names[key]

    def own(self, s: dict, path: str, stack: tuple):
        """The node's own keywords (no $ref), normalised."""
        s = dict(s)
        _draft3(s)
        _draft4(s)
        nullable = s.pop("nullable", False) is True
        if "format" in s and (s["format"] not in FORMATS or not isinstance(s["format"], str)):
            del s["format"]
        if "dependencies" in s:
            for key, dep in (s.pop("dependencies") or {}).items():
                if isinstance(dep, (list, str)):  # a string: draft 3's one dependency
                    s.setdefault("dependentRequired", {})[key] = [dep] if isinstance(dep, str) else dep
                else:
                    s.setdefault("dependentSchemas", {})[key] = dep
        if isinstance(s.get("pattern"), str):
            s["pattern"] = unicode_classes(s["pattern"])
        if isinstance(s.get("patternProperties"), dict):
            s["patternProperties"] = {unicode_classes(k): v for k, v in s["patternProperties"].items()}
        for key, where in ([("pattern", s.get("pattern"))] + [("patternProperties", k) for k in s.get("patternProperties") or {}]):
            if isinstance(where, str):
                try:
                    re.compile(where)
                except re.error as e:
                    raise Refused(key, path, f"{where!r} is not a regular expression Python can check ({e})")
        out = {}
        for key, value in s.items():
            if key not in VALIDATION or key == "$defs":
                continue  # annotations and unknown keywords
            where = f"{path}/{key}"
            if key in SCHEMA_MAPS:
                if not isinstance(value, dict):
                    raise ValueError(f"{where}: must be an object")
                out[key] = {k: self.node(v, f"{where}/{_escape(k)}", stack) for k, v in value.items()}
            elif key in SCHEMA_LISTS:
                if not isinstance(value, list) or not value:
                    raise ValueError(f"{where}: must be a non-empty list")
                out[key] = [self.node(v, f"{where}/{i}", stack) for i, v in enumerate(value)]
            elif key in SCHEMA_ONE:
                out[key] = self.node(value, where, stack)
            else:
                out[key] = copy.deepcopy(value)
        if isinstance(out.get("type"), list):
            if not all(isinstance(t, str) for t in out["type"]):
                raise Refused("type", path, "a schema inside a list of types (draft 3)")
            types = list(dict.fromkeys(out["type"]))
            out["type"] = types[0] if len(types) == 1 else types
        if nullable:
            out = _allow_null(out)
        if "allOf" in out:
            rest = {k: v for k, v in out.items() if k != "allOf"}
            out = _merged(out["allOf"] + ([rest] if rest else []), f"{path}/allOf")
        if "oneOf" in out and "anyOf" not in out and _disjoint(out["oneOf"]):
            out["anyOf"] = out.pop("oneOf")
        return out

def merge(schemas: list, path: str, decoding: bool = False, defs: dict | None = None):
    """allOf of normalised schemas as one schema; Refused where they do not combine. `decoding`:
    a strengthening is enough (for_decoding): `anyOf`s combine branch by branch (the pairs that do
    not combine left out) and a `$ref` part is expanded from `defs`."""
    if any(s is False for s in schemas):
        return False
    schemas = [s for s in schemas if s is not True and s != {}]
    if decoding:
        schemas = [_expand(s, defs or {}, path) for s in schemas]
    if not schemas:
        return {}
    out: dict = {}
    for s in schemas:
        for key, value in s.items():
            if key not in out:
                out[key] = copy.deepcopy(value)
                continue
            out[key] = _combine(key, out[key], value, path, decoding, defs)
    # a part with additionalProperties false admits only its own properties
    for s in schemas:
        if s.get("additionalProperties") is False and "properties" in out and "patternProperties" not in s:
            own = set(s.get("properties", {}))
            for key in [k for k in out["properties"] if k not in own]:
                if key in out.get("required", []):
                    raise Refused("allOf", path, f"property {key!r} is required by one part and "
                                  "forbidden by another (additionalProperties false)")
                del out["properties"][key]
    return out


def _expand(s, defs: dict, path: str, decoding: bool = False):
    """A part `{"$ref": "#/$defs/x", ...}` with the target's keywords in place of the reference."""
    if not isinstance(s, dict) or "$ref" not in s:
        return s
    name = s["$ref"].rsplit("/", 1)[-1]
    if name not in defs:
        raise Refused("$ref", path, f"{s['$ref']!r} does not resolve")
    rest = {k: v for k, v in s.items() if k != "$ref"}
    target = defs[name]
    return merge([target, rest], path, decoding, defs) if rest else target


def _merged(schemas: list, path: str):
    """One schema when the parts merge, else {"allOf": parts} (for_decoding tries again)."""
    try:
        return merge(schemas, path)
    except Refused:
        return {"allOf": [s for s in schemas if s is not True and s != {}]}


def _combine(key: str, a, b, path: str, decoding: bool = False, defs: dict | None = None):
    if a == b:
        return a
    if key == "properties":
        out = dict(a)
        for k, v in b.items():
            out[k] = merge([out[k], v], f"{path}/properties/{_escape(k)}", decoding, defs) if k in out else v
        return out
    if key == "required":
        return list(dict.fromkeys(list(a) + list(b)))
    if key == "type":
        ta = set(a if isinstance(a, list) else [a])
        tb = set(b if isinstance(b, list) else [b])
        if "number" in ta and "integer" in tb:
            ta.add("integer")
        if "number" in tb and "integer" in ta:
            tb.add("integer")
        both = [t for t in TYPES if t in ta & tb]
        if not both:
            raise Refused("allOf", path, f"the parts allow no common type ({a} and {b})")
        return both[0] if len(both) == 1 else both
    if key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"):
        return max(a, b)
    if key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"):
        return min(a, b)
    if key == "enum":
        return [v for v in a if v in b]
    if key == "uniqueItems":
        return bool(a or b)
    if key in ("additionalProperties", "items", "propertyNames"):
        return merge([a, b], f"{path}/{key}", decoding, defs)
    if key == "anyOf" and decoding:
        pairs = []
        for x in a:
            for y in b:
                try:
                    pairs.append(merge([x, y], f"{path}/anyOf", decoding, defs))
                except Refused:
                    continue  # a pair that does not combine is left out (a strengthening)
        if not pairs:
            raise Refused("allOf", path, "no pair of the parts' anyOf branches combines")
        return pairs
    if key == "pattern" and decoding:
        raise Refused("pattern", path, "two patterns on one string (the grammar takes one)")
    if key == "dependentRequired":
        out = dict(a)
        for k, v in b.items():
            out[k] = list(dict.fromkeys(out.get(k, []) + v))
        return out
    raise Refused("allOf", path, f"the parts' {key!r} do not combine into one schema")


# Unicode property classes (ECMA-262 `u` patterns) Python's re lacks, as explicit ranges: (inside a
# class, as a class)
_PROPERTIES = {"Cc": r"\x00-\x1f\x7f-\x9f"}


def unicode_classes(pattern: str) -> str:
    r"""`pattern` with `\p{Cc}` / `\P{Cc}` written as explicit ranges (the same strings match); other
    properties are left (re then refuses the pattern)."""
    out, i, klass = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        m = re.match(r"\\([pP])\{(\w+)\}", pattern[i:]) if c == "\\" else None
        if m and m.group(2) in _PROPERTIES:
            ranges = _PROPERTIES[m.group(2)]
            if klass and m.group(1) == "p":
                out.append(ranges)
            elif not klass:
                out.append(("[" if m.group(1) == "p" else "[^") + ranges + "]")
            else:  # \P inside a class: not expressible as a range list here
                out.append(m.group())
            i += m.end()
            continue
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not klass:
            klass = True
        elif c == "]" and klass:
            klass = False
        out.append(c)
        i += 1
    return "".join(out)


def _draft3(s: dict) -> None:
    """Draft-03 forms that no later draft reads otherwise -> draft 2020-12 (in place): a `type` list
    holding schemas is an `anyOf` of them and the named types, type `any` is no constraint, a
    property's boolean `required` is its parent's `required` list."""
    t = s.get("type")
    if t == "any" or (isinstance(t, list) and "any" in t):
        del s["type"]
    elif isinstance(t, list) and any(isinstance(x, dict) for x in t):
        branches = [x if isinstance(x, dict) else {"type": x} for x in s.pop("type")]
        if "anyOf" in s:
            s["allOf"] = list(s.get("allOf", [])) + [{"anyOf": branches}]
        else:
            s["anyOf"] = branches
    if isinstance(s.get("required"), bool):
        del s["required"]  # on a property it is read by the parent (below); elsewhere it means nothing
    props = s.get("properties")
    if isinstance(props, dict) and any(isinstance(v, dict) and isinstance(v.get("required"), bool)
                                       for v in props.values()):
        required = list(s.get("required", []))
        for k, v in props.items():
            if isinstance(v, dict) and v.get("required") is True and k not in required:
                required.append(k)
        s["properties"] = {k: ({x: y for x, y in v.items() if x != "required"}
                               if isinstance(v, dict) and isinstance(v.get("required"), bool) else v)
                           for k, v in props.items()}
        if required:
            s["required"] = required


def _draft4(s: dict) -> None:
    """Draft-04 spellings -> draft 2020-12 (in place)."""
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(s.get(key), bool):
            if s.pop(key) and bound in s:
                s[key] = s.pop(bound)
    if isinstance(s.get("items"), list):
        s["prefixItems"] = s.pop("items")
        extra = s.pop("additionalItems", True)
        if extra is not True:
            s["items"] = extra
    else:
        s.pop("additionalItems", None)  # without a tuple `items` it has no effect


def _allow_null(s: dict) -> dict:
    if "type" in s and set(s) <= {"type"} | _TYPE_KEYWORDS:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        return s if "null" in types else {**s, "type": types + ["null"]}
    return {"anyOf": [s, {"type": "null"}]}


_TYPE_KEYWORDS = {"properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                  "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems", "uniqueItems",
                  "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
                  "exclusiveMaximum", "multipleOf"}


def _types(s) -> set | None:
    """The JSON types a normalised schema can take (None: not evident)."""
    if not isinstance(s, dict):
        return None
    if "const" in s:
        return {_type_of(s["const"])}
    if "enum" in s:
        return {_type_of(v) for v in s["enum"]}
    t = s.get("type")
    if t is None:
        return None
    out = set(t if isinstance(t, list) else [t])
    return out | {"integer"} if "number" in out else out


def _type_of(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "integer" if v.is_integer() else "number"
    return {str: "string", list: "array", dict: "object"}[type(v)]


def _tags(s) -> dict | None:
    """{property: set of JSON texts} of the required properties fixed by const / enum."""
    if not isinstance(s, dict):
        return None
    out = {}
    for key in s.get("required", []):
        p = s.get("properties", {}).get(key)
        if isinstance(p, dict) and ("const" in p or "enum" in p):
            out[key] = {json.dumps(v, sort_keys=True) for v in ([p["const"]] if "const" in p else p["enum"])}
    return out


def _disjoint(branches: list) -> bool:
    """No document can match two of the branches (so oneOf = anyOf)."""
    for i, a in enumerate(branches):
        for b in branches[i + 1:]:
            ta, tb = _types(a), _types(b)
            if ta is not None and tb is not None and not (ta & tb):
                continue
            if ta is not None and tb is not None and ta == tb and ta <= {"string", "integer", "number", "boolean",
                                                                         "null"} and "enum" in a and "enum" in b:
                if not {json.dumps(v) for v in a["enum"]} & {json.dumps(v) for v in b["enum"]}:
                    continue
            tags_a, tags_b = _tags(a), _tags(b)
            if tags_a and tags_b and any(k in tags_b and not (tags_a[k] & tags_b[k]) for k in tags_a):
                continue
            return False
    return True


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


# ---- for the grammar path ----------------------------------------------------------------------------
STRING_CAP = 24  # characters of a string without maxLength (a bound the grammar decodes within)
ARRAY_CAP = 3  # items of an array without maxItems
NUMBER_CAP = 10**9  # the width of the range given to a number without a minimum or maximum
# keywords the grammar library does not enforce and `for_decoding` cannot strengthen away
UNENFORCED = ("if", "then", "else", "contains", "minContains", "maxContains", "dependentSchemas",
              "unevaluatedItems")


def for_decoding(schema, path: str = "#", defs: dict | None = None, refs: tuple = ()):
    """A normalised schema strengthened so the grammar path can decode it and every document it
    accepts is valid under `schema`: free strings and arrays bounded (STRING_CAP, ARRAY_CAP),
    `allOf` merged (anyOf branches paired), `if`/`then` as both (the `if` made to hold),
    `dependentRequired` and `not` met by leaving optional keys or types out, `unevaluatedProperties`
    as `additionalProperties`. `Refused` for what the grammar cannot enforce (UNENFORCED, other `not`s)."""
    if not isinstance(schema, dict):
        return schema
    _count_node()
    if defs is None:
        defs = schema.get("$defs", {})
    s = dict(schema)
    if "$ref" in s and set(s) - {"$ref", "$defs"}:
        refs = _entered(refs, s["$ref"], path)
        # xgrammar reads a $ref alone (`{"$ref": <integer>, "maximum": 3}` accepted 7): the target's
        # keywords merged with the siblings instead
        s = {**_expand({k: v for k, v in s.items() if k != "$defs"}, defs, path, True),
             **({"$defs": s["$defs"]} if "$defs" in s else {})}
    if "allOf" in s:
        for p in s["allOf"]:
            if isinstance(p, dict) and isinstance(p.get("$ref"), str):
                refs = _entered(refs, p["$ref"], path)
        raw = [_expand(p, defs, path) for p in s.pop("allOf")]
        try:
            s = merge([for_decoding(p, f"{path}/allOf/{i}", defs, refs) for i, p in enumerate(raw)] + [s],
                      f"{path}/allOf", True, defs)
        except Refused:  # conditions made to hold in each part may conflict: leave them to the final check
            bare = [{k: v for k, v in p.items() if k not in ("if", "then", "else")} if isinstance(p, dict) else p
                    for p in raw]
            s = merge([for_decoding(p, f"{path}/allOf/{i}", defs, refs) for i, p in enumerate(bare)] + [s],
                      f"{path}/allOf", True, defs)
        if not isinstance(s, dict):
            return s
    if "if" in s:
        cond, then = s.pop("if"), s.pop("then", True)
        s.pop("else", None)
        if then is not True:
            try:
                met = merge([s, cond, then], f"{path}/if", True, defs)
            except Refused:  # the condition conflicts with the rest: left to the final check
                met = None
            if isinstance(met, dict):
                s = met
    s.pop("then", None)
    s.pop("else", None)
    if "enum" in s or "const" in s:
        return _enum_only(s, path, defs)
    branches = [k for k in ("anyOf", "oneOf") if k in s]
    if len(branches) == 1 and set(s) - {branches[0], "$defs"}:
        return for_decoding(_distribute(s, branches[0], path, defs), path, defs, refs)
    if "contains" in s and "maxContains" not in s and "prefixItems" not in s:
        # at least minContains items match: the first ones laid out as contains + items (a strengthening)
        need, item = s.get("minContains", 1), s.get("items", True)
        try:
            first = merge([s["contains"], item], f"{path}/contains", True, defs) if item is not True else s["contains"]
        except Refused:
            first = None
        if first is not None and isinstance(need, int) and need <= ARRAY_CAP:
            s.pop("contains")
            s.pop("minContains", None)
            s["prefixItems"] = [first] * need
            s["minItems"] = max(s.get("minItems", 0), need)
    for key in UNENFORCED:
        if key in s:
            raise Refused(key, f"{path}", "the grammar path cannot enforce it")
    if "unevaluatedProperties" in s:
        u = s.pop("unevaluatedProperties")
        if any(k in s for k in ("anyOf", "oneOf")) and u is not True:
            raise Refused("unevaluatedProperties", path, "with applicators, the grammar path cannot enforce it")
        if "additionalProperties" not in s:
            s["additionalProperties"] = u
    required = list(s.get("required", []))
    props = dict(s.get("properties", {}))
    drop = set()
    for key, deps in s.pop("dependentRequired", {}).items():
        if key in required:
            required += [d for d in deps if d not in required]
        else:
            drop.add(key)
    if "not" in s:
        s, keys = _negate(s, s.pop("not"), f"{path}/not")
        drop |= keys
    if any(k in required for k in drop):
        raise Refused("not" if "not" in schema else "dependentRequired", path, "cannot be met")
    for key in drop:  # left out (without additionalProperties the grammar writes no other key)
        props.pop(key, None)
    for key in required:
        if key not in props:
            props[key] = _undeclared(s, key, path)
    if "properties" in s or props:
        out = {}
        for k, v in props.items():
            if _never(v) and k not in required:
                continue  # a property that may not be present: left out
            try:
                out[k] = for_decoding(v, f"{path}/properties/{_escape(k)}", defs, refs)
            except TooLarge:
                raise
            except Refused:
                if k in required:
                    raise
                # no value satisfies it, or none the grammar can enforce, or a recursion bounded as unroll
                # bounds one: the optional property is left out (a strengthening)
                continue
        s["properties"] = out
    if required:
        s["required"] = required
    for key in ("additionalProperties", "items", "propertyNames"):
        if isinstance(s.get(key), dict):
            s[key] = for_decoding(s[key], f"{path}/{key}", defs, refs)
    for key in ("patternProperties", "$defs"):
        if key in s:
            s[key] = {k: for_decoding(v, f"{path}/{key}/{_escape(k)}", defs, refs) for k, v in s[key].items()}
    if "prefixItems" in s:
        s["prefixItems"] = [for_decoding(v, f"{path}/prefixItems/{i}", defs, refs) for i, v in enumerate(s["prefixItems"])]
    for key in ("anyOf", "oneOf"):
        if key in s:
            s[key] = _branches(s[key], f"{path}/{key}", defs, refs)
    if "oneOf" in s:  # the grammar reads oneOf as anyOf; the final check tells an overlap
        if "anyOf" in s:
            raise Refused("oneOf", path, "beside anyOf")
        s["anyOf"] = s.pop("oneOf")
    if (isinstance(s.get("additionalProperties"), dict) or "patternProperties" in s) and "propertyNames" not in s:
        s["propertyNames"] = {"maxLength": STRING_CAP}  # map keys bounded, and their number
    if isinstance(s.get("additionalProperties"), dict) or "patternProperties" in s:
        s.setdefault("maxProperties", max(s.get("minProperties", 0), len(s.get("properties", {})) + ARRAY_CAP))
    types = _types(s)
    if "format" in s and "pattern" not in s and s["format"] in FORMAT_PATTERNS and (types is None or "string" in types):
        pattern = _format_pattern(s["format"], s.get("maxLength"))
        if pattern is not None:
            del s["format"]
            s["pattern"] = pattern
    if isinstance(s.get("pattern"), str) and (types is None or "string" in types):
        s["pattern"] = bounded_pattern(escape_controls(s["pattern"]), s.get("maxLength", 2 * STRING_CAP))
    free = not any(k in s for k in ("enum", "const", "pattern", "format", "maxLength"))
    if free and (types is None or "string" in types) and ("type" in s or "minLength" in s):
        s["maxLength"] = max(s.get("minLength", 0), STRING_CAP)
    if types is not None and types & {"integer", "number"} and not {"enum", "const"} & set(s):
        _bound_number(s)
    if types is not None and "array" in types and "items" not in s and s.get("minItems", 0) > len(s.get("prefixItems", [])):
        # in strict mode xgrammar allows no items beyond prefixItems where `items` is absent, and
        # refuses the schema when minItems asks for more (GitHub workflows, GitLab CI, draft-04's
        # meta-schema): any scalar items instead, bounded
        s["items"] = for_decoding({"type": ["string", "integer", "boolean", "null"]}, f"{path}/items", defs, refs)
    if "maxItems" not in s and (types is None or "array" in types) and ("type" in s or "items" in s):
        s["maxItems"] = max(s.get("minItems", 0), len(s.get("prefixItems", [])), ARRAY_CAP)
    return s


ANY_VALUE = {"type": ["string", "integer", "boolean", "null"]}  # what a required key nothing declares is given


def _undeclared(s: dict, key: str, path: str):
    """The schema of a required key `properties` does not declare: its patternProperties' (merged), else
    additionalProperties' (a schema, or true: ANY_VALUE); Refused when additionalProperties is false."""
    patterns = [v for p, v in (s.get("patternProperties") or {}).items() if re.search(p, key)]
    if patterns:
        return patterns[0] if len(patterns) == 1 else {"allOf": patterns}
    extra = s.get("additionalProperties", True)
    if extra is False or _never(extra):
        raise Refused("required", path, f"{key!r} is required, but properties does not declare it and "
                      "additionalProperties is false")
    return extra if isinstance(extra, dict) and extra != {} else dict(ANY_VALUE)


def _enum_only(s: dict, path: str, defs: dict) -> dict:
    """An enum / const node as the enum of its values that the keywords beside them accept (xgrammar reads
    the enum alone); Refused (keyword "enum") when none does."""
    from jsonschema import FormatChecker, validators

    values = s["enum"] if "enum" in s else [s["const"]]
    if "enum" in s and "const" in s:
        values = [v for v in values if v == s["const"]]
    rest = {k: v for k, v in s.items() if k not in ("enum", "const", "$defs")}
    if rest:
        check = validators.validator_for({})({**rest, "$defs": defs}, format_checker=FormatChecker())
        values = [v for v in values if check.is_valid(v)]
    if not values:
        raise Refused("enum", path, "no value satisfies the keywords beside it")
    return {"enum": values, **({"$defs": s["$defs"]} if "$defs" in s else {})}


def _branches(branches: list, path: str, defs: dict, refs: tuple) -> list:
    """The anyOf / oneOf branches made decodable; a branch refused (e.g. one whose required property
    no value satisfies) is left out (a strengthening), Refused only when none is left."""
    out, first = [], None
    for i, b in enumerate(branches):
        try:
            out.append(for_decoding(b, f"{path}/{i}", defs, refs))
        except TooLarge:
            raise
        except Refused as e:
            first = first or e
    if not out:
        raise first
    return out


def _entered(refs: tuple, ref: str, path: str) -> tuple:
    """The $refs for_decoding has expanded on the way to `path`, with `ref`: unroll bounds a bare
    `$ref`, while one beside other keywords (or in an allOf) is expanded here, so a recursion through
    it (renovate's config) would nest for ever; TooDeep past RECURSION expansions of one target."""
    if refs.count(ref) >= RECURSION:
        raise TooDeep("$ref", path, f"{ref!r} recurses more than {RECURSION} levels beside other keywords")
    return refs + (ref,)


def _bound_number(s: dict) -> None:
    """Both numeric bounds on a number (in place): xgrammar lets an unbounded integer or number run to
    any number of digits (a model that favours digits never ends the value: pydantic's Trip ran out of
    max_tokens), while with both a minimum and a maximum it bounds the digits (and a number's fraction
    to 6 digits). NUMBER_CAP past the bound that is given, or either side of 0."""
    low = next((s[k] for k in ("minimum", "exclusiveMinimum") if isinstance(s.get(k), (int, float))), None)
    high = next((s[k] for k in ("maximum", "exclusiveMaximum") if isinstance(s.get(k), (int, float))), None)
    if low is None:
        s["minimum"] = (min(high, 0) if high is not None else 0) - NUMBER_CAP
    if high is None:
        s["maximum"] = (max(low, 0) if low is not None else 0) + NUMBER_CAP


def _distribute(s: dict, key: str, path: str, defs: dict) -> dict:
    """`{..., "anyOf": [B1, B2]}` as `{"anyOf": [{... + B1}, {... + B2}]}` (the same for oneOf; the
    same meaning): xgrammar reads an anyOf alone and ignores its siblings (measured: with
    `{"type": "object", "anyOf": [{"required": ["a"]}]}` it accepts `82`). A branch that does not
    combine with the siblings is left out; none left is Refused."""
    rest = {k: v for k, v in s.items() if k not in (key, "$defs")}
    out = []
    for i, b in enumerate(s[key]):
        try:
            m = merge([rest, b], f"{path}/{key}/{i}", True, defs)
        except Refused:
            continue
        if m is not False:
            out.append(m)
    if not out:
        raise Refused(key, path, "no branch combines with the keywords beside it")
    return {key: out, **({"$defs": s["$defs"]} if "$defs" in s else {})}


# `format` as a bounded pattern for the grammar (xgrammar ignores maxLength next to a format, so a
# formatted string need never end); each matches only strings jsonschema's format checker accepts
_DAY = r"[12]\d{3}-(0[1-9]|1[0-2])-(0[1-9]|1\d|2[0-8])"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,3})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
FORMAT_PATTERNS = {
    "date": f"^{_DAY}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DAY}T{_TIME}$",
    "uuid": r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
    "ipv6": r"^([0-9a-f]{1,4}:){7}[0-9a-f]{1,4}$",
    "email": r"^[a-z0-9._+-]{1,N}@[a-z0-9]{1,N}\.[a-z]{2,6}$",
    "hostname": r"^([a-z0-9]{1,N}\.){0,2}[a-z][a-z0-9]{0,N}$",
    "uri": r"^https?://[a-z0-9]{1,N}(\.[a-z0-9]{1,N}){0,2}(/[a-zA-Z0-9._~-]{1,N}){0,3}$",
}


def _format_pattern(fmt: str, max_length: int | None) -> str | None:
    """FORMAT_PATTERNS[fmt] with its free parts (N) sized so that the whole stays within `max_length`
    (None when it cannot: the format is then left as it is)."""
    pattern = FORMAT_PATTERNS[fmt]
    if fmt == "time" and not _rfc3339_time():
        pattern = r"^([01]\d|2[0-3]):[0-5]\d:[0-5]\d$"  # the draft-3 checker jsonschema falls back on
    if ",N}" not in pattern:
        return pattern
    fixed, per_n = {"email": (8, 2), "hostname": (3, 3), "uri": (13, 6)}[fmt]  # length = fixed + per_n * N
    n = 12 if max_length is None else min(12, (max_length - fixed) // per_n)
    return pattern.replace(",N}", f",{n}}}") if n >= 1 else None


def escape_controls(pattern: str) -> str:
    r"""A pattern with its raw control characters written as escapes (`\n`, `\x01`; the same regular
    expression): xgrammar's lexer rejects a raw newline in a character class (GitHub actions'
    `[\r\n]`, written with the characters themselves, was refused)."""
    def one(m):
        slashes = m.group(1)[:len(m.group(1)) // 2 * 2]  # an escaped control character is the character
        c = m.group(2)
        return slashes + {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, f"\\x{ord(c):02x}")
    return re.sub(r"(\\*)([\x00-\x1f])", one, pattern)


def _width(pattern: str) -> int | None:
    """The longest string `pattern` matches (None: it does not compile in Python's re)."""
    import re._parser as sre

    try:
        return sre.parse(pattern).getwidth()[1]
    except (re.error, RecursionError, OverflowError):
        return None


def bounded_pattern(pattern: str, max_length: int) -> str:
    """`pattern` with its unbounded repeats (`*`, `+`, `{n,}`) bounded to `{0,k}`, `{1,k}`, `{n,n+k}`,
    k as large as keeps every match within `max_length` characters (at least 1): a strengthening
    (fewer strings match) that makes the string end, since xgrammar ignores maxLength next to a
    pattern (measured). A pattern already bounded, or one this cannot rewrite, is returned as it is."""
    width = _width(pattern)
    if width is None or width <= max_length:
        return pattern

    def rewrite(k: int) -> str:
        out, i, klass = [], 0, False
        while i < len(pattern):
            c = pattern[i]
            if c == "\\":
                out.append(pattern[i:i + 2])
                i += 2
                continue
            if klass:
                klass = c != "]" or out[-1] in ("[", "[^")
            elif c == "[":
                klass = True
                if pattern[i + 1:i + 2] == "^":
                    c, i = "[^", i + 1
            elif c == "*" and out:
                c = f"{{0,{k}}}"
            elif c == "+" and out and not out[-1].endswith(("}", "*", "+", "?")):
                c = f"{{1,{k}}}"
            elif c == "{":
                m = re.match(r"\{(\d+),\}", pattern[i:])
                if m:
                    out.append(f"{{{m.group(1)},{int(m.group(1)) + k}}}")
                    i += m.end()
                    continue
            out.append(c)
            i += 1
        return "".join(out)

    for k in range(16, 0, -1):
        p = rewrite(k)
        w = _width(p)
        if w is None:
            return pattern
        if w <= max_length or k == 1:
            return p if w < 1 << 32 else pattern
    return pattern


def _rfc3339_time() -> bool:
    """Whether jsonschema checks `time` as RFC 3339 (with rfc3339-validator installed) rather than
    draft 3's HH:MM:SS, which rejects an offset."""
    from jsonschema import FormatChecker

    return FormatChecker().conforms("00:00:00Z", "time")


def _never(s) -> bool:
    return s is False or (isinstance(s, dict) and s.get("not", False) in ({}, True))  # whatever is beside it


def _negate(s: dict, neg, path: str) -> tuple[dict, set]:
    """`s` strengthened to meet `not: neg`, and the optional keys to leave out. A `not` this cannot
    express (e.g. a string `not: {pattern}`) is left to the final check (grammar_json retries)."""
    if neg is False:
        return s, set()
    if isinstance(neg, dict):
        neg = dict(neg)
        if isinstance(neg.get("properties"), dict) and all(v in (True, {}) for v in neg["properties"].values()):
            neg.pop("properties")
        if neg.get("type") == "object" and "required" in neg:
            neg.pop("type")
    if isinstance(neg, dict) and set(neg) == {"required"} and neg["required"]:
        return s, {neg["required"][0]}
    if isinstance(neg, dict) and set(neg) == {"anyOf"} and all(
            isinstance(b, dict) and set(b) == {"required"} and b["required"] for b in neg["anyOf"]):
        return s, {b["required"][0] for b in neg["anyOf"]}
    if isinstance(neg, dict) and set(neg) == {"type"}:
        banned = set(neg["type"] if isinstance(neg["type"], list) else [neg["type"]])
        have = s.get("type", list(TYPES))
        have = [t for t in (have if isinstance(have, list) else [have]) if t not in banned]
        if "number" in banned:
            have = [t for t in have if t != "integer"]
        if not have:
            raise Refused("not", path, "no type is left")
        return {**s, "type": have[0] if len(have) == 1 else have}, set()
    if isinstance(neg, dict) and set(neg) <= {"enum", "const"} and "enum" in s:
        bad = neg.get("enum", []) + ([neg["const"]] if "const" in neg else [])
        left = [v for v in s["enum"] if v not in bad]
        if not left:
            raise Refused("not", path, "no enum value is left")
        return {**s, "enum": left}, set()
    if neg in ({}, True):
        raise Refused("not", path, "nothing is valid here")
    return s, set()


RECURSION = 2  # levels of a recursive schema the grammar path lays out before it stops recursing


def unroll(schema, depth: int = RECURSION):
    """A normalised schema with its recursive `$ref`s expanded `depth` levels deep; below that an
    optional property or an array item that would recurse is left out (a strengthening: the grammar
    then writes no deeper), and a required one keeps its `$ref`."""
    if not isinstance(schema, dict) or "$defs" not in schema:
        return schema
    defs = schema["$defs"]
    cut = object()

    def ref_of(s):
        return s["$ref"].rsplit("/", 1)[-1] if isinstance(s, dict) and set(s) == {"$ref"} else None

    def walk(s, level):
        if not isinstance(s, dict):
            return s
        name = ref_of(s)
        if name is not None and name in defs:
            return walk(defs[name], level + 1) if level < depth else cut
        out = {}
        for key, value in s.items():
            if key == "$defs":
                continue
            if key in ("properties", "patternProperties", "dependentSchemas"):
                kids = {}
                for k, v in value.items():
                    w = walk(v, level)
                    if w is cut:
                        if key != "properties" or k in s.get("required", []):
                            kids[k] = v
                        continue
                    kids[k] = w
                out[key] = kids
            elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
                items = [walk(v, level) for v in value]
                if key == "anyOf" and any(i is not cut for i in items):
                    items = [i for i in items if i is not cut]
                out[key] = [v if i is cut else i for i, v in zip(items, value)] if cut in items else items
            elif key in ("items", "additionalProperties", "propertyNames", "not", "if", "then", "else", "contains"):
                w = walk(value, level)
                if w is cut and key == "items" and s.get("minItems", 0) == 0:
                    out["maxItems"] = 0
                    continue
                if w is cut and key == "additionalProperties":
                    out[key] = False
                    continue
                out[key] = value if w is cut else w
            else:
                out[key] = value
        if out.get("maxItems") == 0:
            out.pop("items", None)
        return out

    body = walk({k: v for k, v in schema.items() if k != "$defs"}, 0)
    return {**body, "$defs": defs} if body is not cut else schema
