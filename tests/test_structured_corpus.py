"""The structured-output corpus (clover/structured/corpus.py): every schema yields a document that
json.loads + jsonschema accept, or is refused (a 400 naming the keyword) - never an invalid one -
on a tiny random model; normalisation on its own; the official openai client's `parse` with
pydantic models and forced calls over BFCL-style tool sets.

The fast run takes a sample of the corpus (every source); CLOVER_CORPUS=full runs all of it
(every SchemaStore definition too: long), and `clover bench structured --corpus` reports coverage."""

import json
import os

import openai
import pytest
from jsonschema import FormatChecker, validators

import clover
from clover.api import eos_ids
from clover.server import Settings, create_app
from clover.structured import Refused, corpus, normalize
from helpers import save_tiny_model
from server_utils import RunningServer

FULL = os.environ.get("CLOVER_CORPUS") == "full"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return clover.load(save_tiny_model(tmp_path_factory.mktemp("corpus-model")))


def _entries():
    entries = corpus.load(per_file=None if FULL else 1)
    if FULL:
        return entries
    # the fast sample: every source, the big SchemaStore documents (seconds to compile each) left to the full run
    small = [e for e in entries if len(json.dumps(e["schema"])) < 40_000 or e["root"] is not None]
    by_source = {}
    for e in small:
        by_source.setdefault(e["source"], []).append(e)
    return [e for s, es in by_source.items() for e in (es if s != "schemastore" else es[:24])][::4]


def test_the_corpus_is_big_and_real_world_shaped():
    entries = corpus.load(per_file=6)
    assert len(entries) >= 200
    assert {e["source"] for e in entries} == set(corpus.SOURCES)
    assert sum(e["source"] == "schemastore" for e in entries) >= 100


def test_normalisation_keeps_meaning():
    s = normalize({"id": "x", "type": "object", "x-vendor": 1, "readonly": True, "properties": {
        "a": {"$ref": "#/definitions/a"}, "n": {"type": "integer", "nullable": True},
        "f": {"type": "number", "format": "float"}, "d": {"type": "string", "format": "date"},
        "lo": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
        "t": {"allOf": [{"$ref": "#/definitions/a"}, {"required": ["k"]}]}},
        "definitions": {"a": {"type": "object", "title": "A", "properties": {"k": {"type": "string"}}}}})
    assert s == {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"k": {"type": "string"}}},
        "n": {"type": ["integer", "null"]}, "f": {"type": "number"}, "d": {"type": "string", "format": "date"},
        "lo": {"type": "number", "exclusiveMinimum": 0},
        "t": {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}}}
    rec = normalize({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}})
    assert rec["properties"]["kids"]["items"] == {"$ref": "#/$defs/root"} and "root" in rec["$defs"]
    assert normalize({"oneOf": [{"type": "string"}, {"type": "integer"}]}) == {
        "anyOf": [{"type": "string"}, {"type": "integer"}]}  # disjoint branches
    with pytest.raises(Refused, match="'\\$ref' at #/properties/a"):
        normalize({"properties": {"a": {"$ref": "other.json#/x"}}})


def test_every_sampled_schema_is_valid_or_refused(tiny):
    model, tok = tiny
    records = [corpus.answer(model, tok, e, max_new_tokens=600) for e in _entries()]
    bad = [r for r in records if r["method"] != "refused" and not r["valid"] and r.get("complete", True)]
    assert not bad, bad[:3]  # 0 invalid documents: a complete reply is always valid
    claimed = [r for r in records if r.get("claimed_valid") and not r["valid"]]
    assert not claimed, claimed[:3]  # the verdict is about the returned text
    summary = corpus.summarize(records)
    assert set(summary["per_source"]) == set(corpus.SOURCES)
    assert summary["overall"]["coverage"] >= 0.8, summary["overall"]
    assert all(r.get("keyword") for r in records if r["method"] == "refused")


# ---- the official client ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(tiny):
    model, tokenizer = tiny
    settings = Settings(model_id="tiny", block_size=8, threshold=0.5, max_batch=8, max_queue=16)
    with RunningServer(create_app(model, tokenizer, settings, eos_ids(model, tokenizer))) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)


ASK = [{"role": "user", "content": "Fill it in."}]


@pytest.mark.parametrize("model", corpus.PYDANTIC, ids=[m.__name__ for m in corpus.PYDANTIC])
def test_parse_with_pydantic_models(client, model):
    """chat.completions.parse (strict json_schema from the model) parses every reply, streamed too."""
    one = client.chat.completions.parse(model="tiny", messages=ASK, response_format=model, max_tokens=900)
    parsed = one.choices[0].message.parsed
    assert isinstance(parsed, model) and one.choices[0].finish_reason == "stop"
    info = one.model_extra["clover"]["structured"][0]
    assert info["valid"] and info["method"] in ("infill", "grammar")
    with client.chat.completions.stream(model="tiny", messages=ASK, response_format=model, max_tokens=900) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.content == one.choices[0].message.content


@pytest.mark.parametrize("request_index", [i for i, r in enumerate(corpus.bfcl_requests()) if len(r) <= 3][::2])
def test_forced_calls_over_bfcl_tools(client, request_index):
    """tool_choice "required" and a named function always return one valid call, stream and not (the
    requests whose tools leave the character-level test model room for the call in its context).
    parallel_tool_calls=False: one call exactly (several calls are tests/test_server_tools_openai.py's)."""
    tools = corpus.bfcl_requests()[request_index]
    specs = {t["function"]["name"]: normalize(t["function"]["parameters"]) for t in tools}
    for choice in ["required", {"type": "function", "function": {"name": tools[-1]["function"]["name"]}}]:
        kw = dict(model="tiny", messages=ASK, tools=tools, tool_choice=choice, parallel_tool_calls=False)  # the budget: what the context leaves
        one = client.chat.completions.create(**kw)
        (call,) = one.choices[0].message.tool_calls
        finish, info = one.choices[0].finish_reason, one.model_extra["clover"]["structured"][0]
        assert one.choices[0].message.content is None and finish in ("tool_calls", "length")
        if finish == "length":  # the char-level model's context ran out mid-call: said so, never "valid"
            assert not info["valid"] and request_index > 0
            continue
        assert info["valid"]
        schema = specs[call.function.name]
        assert not list(validators.validator_for(schema)(schema, format_checker=FormatChecker()).iter_errors(
            json.loads(call.function.arguments)))
        if isinstance(choice, dict):
            assert call.function.name == choice["function"]["name"]
        chunks = list(client.chat.completions.create(**kw, stream=True))
        streamed = "".join(tc.function.arguments or "" for ch in chunks for tc in ch.choices[0].delta.tool_calls or [])
        assert streamed == call.function.arguments and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_dynamic_and_recursive_refs_resolve_in_one_document():
    """In one document evaluated from its root the dynamic scope is static: `$recursiveRef: "#"` and
    `$dynamicRef: "#meta"` (root `$dynamicAnchor: meta`) are the root, a `$dynamicRef` to an anchor
    below the root is that subschema; an embedded resource is still refused."""


    meta = {"$dynamicAnchor": "meta", "type": "object", "properties": {
        "kid": {"$dynamicRef": "#meta"}, "n": {"$dynamicRef": "#num"}, "m": {"$ref": "#num"}},
        "$defs": {"num": {"$anchor": "num", "type": "integer", "maximum": 3}}}
    s = normalize(meta)
    check = validators.validator_for(s)(s)
    assert check.is_valid({"kid": {"kid": {"n": 1}}, "m": 2})
    assert not check.is_valid({"kid": {"kid": {"n": 7}}}) and not check.is_valid({"kid": 1}) and not check.is_valid({"m": 4})
    rec = normalize({"$recursiveAnchor": True, "type": "object", "additionalProperties": {"$recursiveRef": "#"}})
    check = validators.validator_for(rec)(rec)
    assert check.is_valid({"a": {"b": {}}}) and not check.is_valid({"a": {"b": 1}})
    with pytest.raises(Refused, match=r"\$dynamicRef"):
        normalize({"type": "object", "properties": {"a": {"$dynamicRef": "#nowhere"}}})
    with pytest.raises(Refused, match="embedded"):
        normalize({"properties": {"a": {"$id": "http://x/y", "$dynamicRef": "#meta"}}})


def test_only_selects_entries_by_id(capsys):
    """`--only` reruns just the failing entries: ids containing one of the comma-separated words."""
    from clover.cli import main

    ids = [e["id"] for e in corpus.load(per_file=0, sources=("pydantic",), only="Trip,MaybeAge")]
    assert sorted(ids) == ["MaybeAge", "Trip"]
    assert main(["bench", "structured", "--corpus", "--only", "no-such-schema-id"]) == 2
    assert "matches no corpus entry" in capsys.readouterr().err


# known valid and invalid instances of a meta-schema: schemas, right and wrong at several depths
SCHEMA_INSTANCES = [
    {}, True, {"type": "string", "minLength": 1}, {"type": ["string", "null"]},
    {"properties": {"a": {"type": "integer", "minimum": 1}}, "required": ["a"]},
    {"items": {"items": {"enum": [1, 2]}}}, {"anyOf": [{"type": "string"}, {"not": {"const": 3}}]},
    {"type": 3}, {"properties": {"a": {"type": "nope"}}}, {"minLength": -1}, {"required": "a"},
    {"items": {"properties": {"b": {"maxItems": "x"}}}}, {"anyOf": []}, {"enum": 5}, 7, "x",
    {"dependencies": {"a": "b"}}, {"type": [{"type": "string"}, "null"]}, {"properties": {"a": {"required": True}}},
]


@pytest.mark.parametrize("entry", corpus.load(per_file=0, sources=("metaschema",)), ids=lambda e: e["id"].split("//")[1])
def test_meta_schemas_normalise_and_classify_as_the_original(entry):
    """Every JSON Schema meta-schema (drafts 3 to 2020-12 and the vocabularies: remote `$ref`s to one
    another resolved from the bundled copies, `$dynamicRef` / `$recursiveRef` to the outermost anchor,
    draft 3's schemas inside `type`) normalises, offline, to a schema that classifies known valid and
    invalid instances exactly as the original does."""
    original = entry["schema"]
    s = normalize(original)
    assert "://" not in json.dumps(s).replace('"format": "uri"', "")  # no remote reference left
    want = validators.validator_for(original)(original)
    got = validators.validator_for(s)(s)
    verdicts = [(x, want.is_valid(x), got.is_valid(x)) for x in SCHEMA_INSTANCES]
    assert [v for v in verdicts if v[1] != v[2]] == []
    assert {v[1] for v in verdicts} == {True, False}  # the instances tell something apart


def test_remote_refs_resolve_only_to_bundled_meta_schemas():
    """A `$ref` to a json-schema.org draft resolves from the bundled copy (https spelling too); any other
    remote reference is a 400 naming `$ref` and its path."""
    for uri in ("http://json-schema.org/draft-07/schema#", "https://json-schema.org/draft-07/schema",
                "https://json-schema.org/draft/2020-12/schema"):
        original = {"type": "object", "properties": {"schema": {"$ref": uri}}}
        s = normalize(original)
        # jsonschema itself knows drafts 3-7 by their http URIs only (the https one it would fetch)
        bundled = json.loads(json.dumps(original).replace("https://json-schema.org/draft-0", "http://json-schema.org/draft-0"))
        want, got = validators.validator_for(bundled)(bundled), validators.validator_for(s)(s)
        for x in SCHEMA_INSTANCES:
            assert want.is_valid({"schema": x}) == got.is_valid({"schema": x}), (uri, x)
    with pytest.raises(Refused, match="'\\$ref' at #/properties/a"):
        normalize({"properties": {"a": {"$ref": "https://example.com/schemas/thing.json"}}})
    with pytest.raises(Refused, match="'\\$ref' at #/properties/a"):
        normalize({"properties": {"a": {"$ref": "http://json-schema.org/draft-99/schema#"}}})


def test_draft3_forms():
    """Draft 3: schemas inside a `type` list are an anyOf, `any` is no constraint, a property's boolean
    `required` lifts to its parent, a string dependency is one required key."""
    original = {"$schema": "http://json-schema.org/draft-03/schema#", "type": "object", "properties": {
        "a": {"type": ["integer", {"type": "string", "maxLength": 2}], "required": True},
        "b": {"type": "any"}, "c": {"type": "boolean", "required": False}}, "dependencies": {"c": "b"}}
    s = normalize(original)
    want, got = validators.validator_for(original)(original), validators.validator_for(s)(s)
    cases = [{"a": 1}, {"a": "xy"}, {"a": "xyz"}, {}, {"a": 1, "c": True}, {"a": 1, "c": True, "b": None},
             {"a": None}, {"a": 1, "b": [1]}]
    assert [want.is_valid(x) for x in cases] == [got.is_valid(x) for x in cases]
    assert s["required"] == ["a"] and s["dependentRequired"] == {"c": ["b"]}


def test_unicode_property_classes_match_as_unicodedata_says():
    r"""`\p{Cc}` / `\P{Cc}` (CircleCI's orb pattern `[^\s\p{Cc}]`) become explicit ranges that match
    exactly the characters unicodedata calls Cc, alone and inside a class."""
    import random
    import re
    import unicodedata

    from clover.structured.normalize import unicode_classes

    rng = random.Random(0)
    chars = [chr(c) for c in range(0x300)] + [chr(rng.randrange(0x300, 0x110000)) for _ in range(2000)]
    chars = [c for c in chars if not 0xD800 <= ord(c) < 0xE000]
    cc = lambda c: unicodedata.category(c) == "Cc"  # noqa: E731
    for pattern, want in [(r"\p{Cc}", cc), (r"\P{Cc}", lambda c: not cc(c)),
                          (r"[^\s\p{Cc}]", lambda c: not cc(c) and not re.match(r"\s", c)),
                          (r"[a\p{Cc}]", lambda c: c == "a" or cc(c))]:
        got = re.compile(unicode_classes(pattern))
        assert [c for c in chars if bool(got.fullmatch(c)) != want(c)] == [], pattern
    s = normalize({"type": "string", "pattern": r"^[^\s\p{Cc}]+$"})
    assert "\\p" not in s["pattern"]


def test_contains_is_laid_out_as_leading_items():
    """`contains` (+ minContains) becomes leading prefixItems matching contains and items: every array
    the decodable schema accepts is valid under the original."""
    import itertools

    from clover.structured.normalize import for_decoding

    original = {"type": "array", "items": {"type": ["integer", "string"]}, "contains": {"type": "integer", "minimum": 5},
                "minContains": 2}
    d = for_decoding(normalize(original))
    assert "contains" not in d and len(d["prefixItems"]) == 2
    want, got = validators.validator_for(original)(original), validators.validator_for(d)(d)
    values = [1, 5, 9, "a", None]
    arrays = [list(a) for n in range(4) for a in itertools.product(values, repeat=n)]
    accepted = [a for a in arrays if got.is_valid(a)]
    assert accepted and all(want.is_valid(a) for a in accepted)


def test_a_forbidden_optional_property_is_left_out():
    """An optional property whose schema has `not: {}` beside other keywords (Bitbucket's
    `deployment` in a final step) can never be present: left out, not refused."""
    from clover.structured.normalize import for_decoding

    original = {"type": "object", "properties": {"a": {"type": "string"}, "d": {"type": "string", "not": {}}}}
    d = for_decoding(normalize(original))
    assert "d" not in d["properties"]
    assert validators.validator_for(original)(original).is_valid({"a": "x"})
    assert not validators.validator_for(original)(original).is_valid({"d": "x"})
