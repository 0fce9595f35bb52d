"""Schema-guided JSON by infilling (`clover.generate_json`, `clover generate --json-schema`) on a tiny
random model and a small byte-level BPE trained here on JSON text (digits single, GPT-2 style
pre-tokenizer, as Clover's own tokenizer): whatever the model, an infilled document is valid JSON for
its schema, takes at most one forward per slot, and tokenizes as the whole text would."""

import json
import math
import random
import re
from dataclasses import replace

import pytest
import torch
from jsonschema import validate
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import clover
from clover.cli import main
from clover.engine import DecodeConfig, Engine
from clover.structured import BudgetTooSmall, Unsupported, generate_json, infill_json, skeleton
from clover.structured.generate import _number
from helpers import tiny_tokenizer

SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"}}, "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 6},
            "home": {"type": "object", "properties": {
                "city": {"enum": ["Rome", "Oslo", "Paris"]}, "zip": {"type": "integer"}}}}},
        "kind": {"const": "person"}}},
    "enums": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue", "dark red"]}, "size": {"enum": [1, 2, 3, "big", None, True]},
        "level": {"type": "string", "enum": ["low", "high", 3]}}},
    "booleans": {"type": "object", "properties": {
        "a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "null"}}},
    "integers": {"type": "object", "properties": {
        "small": {"type": "integer", "minimum": -5, "exclusiveMaximum": 5},
        "big": {"type": "integer", "minimum": 1000, "maximum": 99999},
        "free": {"type": "integer"}, "positive": {"type": "integer", "exclusiveMinimum": 0}}},
    "numbers": {"type": "object", "properties": {
        "price": {"type": "number", "minimum": 0, "maximum": 100},
        "delta": {"type": "number", "exclusiveMinimum": -1.5},
        "any": {"type": "number"}}},
    "strings": {"type": "object", "properties": {
        "short": {"type": "string", "maxLength": 3}, "text": {"type": "string"},
        "word": {"type": "string", "minLength": 2, "maxLength": 8}}},
    "fixed_array": {"type": "object", "properties": {
        "rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                "minItems": 3, "maxItems": 3},
        "names": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 2, "maxItems": 2}}},
    "bounded_array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 1, "maxItems": 4},
        "points": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "x": {"type": "number"}, "ok": {"type": "boolean"}}}}}},
    "top_level_array": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
}
UNSUPPORTED = {
    "anyOf": ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "'anyOf' not supported"),
    "ref": ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "string"}}},
            "$.a: '$ref'"),
    "patternProperties": ({"type": "object", "patternProperties": {"^a": {"type": "string"}}}, "'patternProperties'"),
    "additionalProperties": ({"type": "object", "additionalProperties": {"type": "string"}},
                             "additionalProperties as a schema"),
    "format": ({"type": "string", "format": "date"}, "'format'"),
    "pattern": ({"type": "string", "pattern": "^a+$"}, "'pattern'"),
    "type_list": ({"type": ["string", "null"]}, "a list of types"),
    "any": ({}, "without a type"),
}
BAD = [
    ([1, 2], "a JSON schema must be an object"),
    ({"type": "strin"}, "not a valid JSON schema"),
    ({"type": "object", "properties": {"a": {"type": "integer", "maximum": "9"}}},
     "not a valid JSON schema at properties/a/maximum"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "no integer within the bounds"),
    ({"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 1}, "minItems 3 > maxItems 1"),
    ({"type": "string", "minLength": 4, "maxLength": 2}, "minLength 4 > maxLength 2"),
    ({"type": "integer", "enum": ["a", "b"]}, "no enum value satisfies the schema"),
]
PROMPT = "Describe the record as JSON."


def json_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE with single digits, trained on JSON documents like the ones above (so it has
    merges such as '":' or '",' that could cross a scaffold / slot boundary)."""
    rng = random.Random(0)
    words = ["red", "green", "blue", "Rome", "Oslo", "Paris", "name", "age", "person", "home", "city", "tags",
             "hello", "world", "true", "false", "null", "big", "low", "high", "the", "record", "as", "JSON"]
    corpus = []
    for _ in range(400):
        doc = {rng.choice(words): rng.choice([rng.randint(-999, 9999), rng.choice(words), rng.random() < 0.5, None,
                                              [rng.choice(words) for _ in range(rng.randint(0, 3))],
                                              {rng.choice(words): round(rng.uniform(-9, 99), 2)}])
               for _ in range(rng.randint(1, 4))}
        corpus.append(f"{' '.join(rng.sample(words, 5))}. {json.dumps(doc)}")
    special = ["<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=special)
    fast.chat_template = tiny_tokenizer().chat_template  # Clover's template, as the shared test tokenizer
    return fast


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from clover.models import CloverForBlockDiffusion, preset_config

    tok = json_tokenizer()
    torch.manual_seed(0)
    config = preset_config("clover-tiny", vocab_size=512, mask_token_id=tok.convert_tokens_to_ids("<|mask|>"),
                           eos_token_id=tok.eos_token_id)
    model = CloverForBlockDiffusion(config)
    model.lm_head.weight.data *= 40.0  # peaked, as tests/helpers.py: confident enough to commit several slots
    folder = tmp_path_factory.mktemp("structured-model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return clover.load(str(folder), device="cpu")


def _bias(model, token_ids, amount: float = 60.0):
    """A hook making `token_ids` the model's favourites everywhere."""
    def hook(module, inputs, output):
        output = output.clone()
        output[..., token_ids] += amount
        return output
    return model.lm_head.register_forward_hook(hook)


def _free_forwards(model, tokenizer, prompt: str, n: int, threshold: float, block_size: int) -> int:
    """Forwards of free generation (low_confidence, no EOS) of n tokens."""
    ids = clover.api.encode(tokenizer, prompt)
    cfg = DecodeConfig(block_size=block_size, threshold=threshold, max_new_tokens=n)
    return Engine(model, cfg).generate([ids])[0].forward_passes


def _has_gates(schema) -> bool:
    return any(type(p).__name__ == "Gate" for p in skeleton(schema).parts)


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _assert_tokens_as_whole_text(tok, out, schema) -> None:
    """The region is the whole text's tokenization, except where a tokenizer may merge scaffold
    with a neighbour: around the gates of optional list items (the separator is its own token) and
    at string values that start or end with punctuation or a space (the BPE may merge it with the
    quote: 'high ", ' tokenizes as 'high' + ' "' + ',' + ' ')."""
    assert tok.decode(out.token_ids) == out.text
    edges = [c for v in _strings(out.value) if v for c in (v[0], v[-1])]
    if not _has_gates(schema) and all(c.isalnum() for c in edges):
        assert out.token_ids == tok(out.text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_infilled_document_is_valid(tiny, name):
    model, tok = tiny
    schema = SCHEMAS[name]
    slots = len(skeleton(schema).slots)
    for threshold, block_size, chat in ((0.9, 32, False), (0.0, 16, True), (1.0, 8, False)):
        out = generate_json(model, tok, PROMPT, schema, chat=chat, threshold=threshold, block_size=block_size)
        assert out.method == "infill" and out.fallback_reason is None, out
        validate(out.value, schema)
        assert out.valid and out.error is None and json.loads(out.text) == out.value
        assert 1 <= out.forward_passes <= slots
        _assert_tokens_as_whole_text(tok, out, schema)


def test_constraints_hold_when_the_model_wants_to_break_them(tiny):
    """Biased towards a quote, a backslash, a newline and digits beyond the bounds, the model still
    writes valid documents: string slots never choose those tokens, numbers are clamped."""
    model, tok = tiny
    bad = sorted({i for i in range(len(tok)) if any(c in tok.decode([i]) for c in '"\\\n')} |
                 {tok.convert_tokens_to_ids("9")})
    handle = _bias(model, bad)
    try:
        for name in ("strings", "integers", "numbers", "bounded_array", "nested"):
            out = generate_json(model, tok, PROMPT, SCHEMAS[name], threshold=0.5)
            validate(out.value, SCHEMAS[name])
            assert out.method == "infill" and out.valid
    finally:
        handle.remove()


def test_bounded_arrays_stop_or_fill(tiny):
    """A gate stops when the closing bracket is the model's favourite, else the list runs to maxItems."""
    model, tok = tiny
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4}
    close = tok("]", add_special_tokens=False).input_ids[0]
    handle = _bias(model, [close])
    try:
        short = generate_json(model, tok, PROMPT, schema)
    finally:
        handle.remove()
    assert short.valid and len(short.value) == 1
    handle = _bias(model, [tok(",", add_special_tokens=False).input_ids[0]])
    try:
        long = generate_json(model, tok, PROMPT, schema)
    finally:
        handle.remove()
    assert long.valid and len(long.value) == 4 and long.text.count(",") == 3


def test_fewer_forwards_than_free_generation(tiny):
    """Infilling takes at most one forward per slot; free generation of the same number of tokens
    takes at least one per block, and on this model more than infilling in total."""
    model, tok = tiny
    infill = free = 0
    for name, schema in SCHEMAS.items():
        out = generate_json(model, tok, PROMPT, schema, threshold=0.9)
        n = len(out.token_ids)
        assert out.forward_passes <= len(skeleton(schema).slots)
        forwards = _free_forwards(model, tok, PROMPT, n, 0.9, 32)
        assert forwards >= math.ceil(n / 32)
        infill, free = infill + out.forward_passes, free + forwards
    assert infill < free


def test_edge_layouts(tiny):
    """A key longer than the model's largest block (its scaffold is cut into scaffold-only units), a
    top-level scalar (its end marker is EOS), lists of optional lists, documents without slots."""
    model, tok = tiny
    long_key = {"type": "object", "properties": {"k" * 90: {"type": "boolean"}, "q" * 200: {"const": 1},
                                                 "b": {"type": "string", "maxLength": 4}}}
    nested = {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "maxItems": 2}
    for schema in (long_key, {"type": "boolean"}, {"type": "number", "maximum": -3}, nested):
        for threshold in (0.0, 1.0):
            out = generate_json(model, tok, PROMPT, schema, threshold=threshold, block_size=8)
            assert out.method == "infill" and out.valid, (schema, out)
    for schema in ({"type": "object", "properties": {}}, {"const": {"a": [1, 2]}}):
        out = generate_json(model, tok, PROMPT, schema)
        assert out.valid and out.forward_passes == 0 and out.value == json.loads(out.text)


def test_layout_scaffold_and_slots():
    sk = skeleton(SCHEMAS["nested"])
    assert sk.describe() == ('{"person": {"name": "⟦string $.person.name⟧", "home": {"city": "⟦Rome|Oslo|Paris⟧", '
                             '"zip":⟦ integer -999999..999999⟧}}, "kind": "person"}')
    sk = skeleton(SCHEMAS["bounded_array"])
    assert sk.describe().startswith('{"tags": [⟦\'\' or close⟧"⟦string $.tags[0]⟧"⟦\',\' or close⟧ "⟦string $.tags[1]⟧"')
    assert len(skeleton(SCHEMAS["fixed_array"]).slots) == 5


def test_prefix_suffix_and_prompt_ids(tiny):
    """The forced tool call form: prompt ids, fixed text around the JSON, tokenized with it."""
    model, tok = tiny
    prefix, suffix = '<tool_call>\n{"name": "add", "arguments": ', "}\n</tool_call>"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    ids = tok("Add 2 and 3.").input_ids
    out = infill_json(model, tok, ids, schema, prefix=prefix, suffix=suffix)
    assert out.method == "infill" and out.valid and set(out.value) == {"a", "b"}
    assert out.token_ids == tok(prefix + out.text + suffix, add_special_tokens=False).input_ids
    with pytest.raises(Unsupported, match="'format'"):
        infill_json(model, tok, ids, UNSUPPORTED["format"][0])
    with pytest.raises(ValueError, match="the prompt is empty"):
        infill_json(model, tok, [], schema)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_schemas_say_why(name):
    schema, reason = UNSUPPORTED[name]
    with pytest.raises(Unsupported, match=reason.replace("$", r"\$")):
        skeleton(schema)


def test_grammar_path_for_what_infilling_cannot_lay_out(tiny):
    """Outside the infiller's layouts the grammar path decodes a valid document (random model)."""
    model, tok = tiny
    schema, reason = UNSUPPORTED["anyOf"]
    out = generate_json(model, tok, PROMPT, schema, max_new_tokens=80)
    assert out.method == "grammar" and reason in out.fallback_reason and out.forward_passes >= 1
    assert out.valid and out.error is None and json.loads(out.text) == out.value
    obj = generate_json(model, tok, PROMPT, {"type": "json_object"}, max_new_tokens=200)
    assert obj.method == "grammar" and "json_object" in obj.fallback_reason
    assert obj.valid and isinstance(json.loads(obj.text), dict)
    long = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]{30}$"}}, "required": ["a"]}
    with pytest.raises(BudgetTooSmall, match=r"max_tokens \(5\) .* the smallest one needs \d+ tokens") as e:
        generate_json(model, tok, PROMPT, long, max_new_tokens=5)  # refused before decoding
    fits = generate_json(model, tok, PROMPT, long, max_new_tokens=e.value.need)
    assert fits.complete and fits.valid and len(fits.token_ids) <= e.value.need


@pytest.mark.parametrize("schema,message", BAD)
def test_bad_schemas_are_value_errors(tiny, schema, message):
    model, tok = tiny
    with pytest.raises(ValueError, match=message):
        generate_json(model, tok, PROMPT, schema)


def test_number_slots_repair_what_they_wrote():
    (p,) = skeleton({"type": "number", "minimum": 0, "maximum": 100}).parts
    assert (p.sep, p.low, p.high, p.decimals) == ("", 0, 100, 2)
    p = replace(p, sep=" ")
    assert _number(" 3.5", p) == " 3.5"  # kept as written
    assert _number("3.14159", p) == " 3.14"
    assert _number(" 007", p) == " 7" and _number(" -4", p) == " 0" and _number(" 12345", p) == " 100"
    assert _number(" --", p) == " 0"


def test_cli_json_schema(tiny, tmp_path, capsys):
    model, tok = tiny
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS["flat"]))
    args = ["generate", "--model", str(folder), "--prompt", PROMPT, "--json-schema"]
    assert main(args + [str(schema), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"value", "text", "valid", "method", "forward_passes", "seconds"} <= set(out) and out["valid"]
    validate(out["value"], SCHEMAS["flat"])
    assert main(args + [str(schema)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == out["value"] and "infill" in captured.err
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "wrong.json").write_text('{"type": "strin"}')
    for path, message in ((tmp_path / "none.json", "no such schema file"), (tmp_path / "bad.json", "not JSON"),
                          (tmp_path / "wrong.json", "not a valid JSON schema")):
        assert main(args + [str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    # --temperature samples under the schema's grammar (the seed repeats it); the Python API takes a Draw
    sampled = args + [str(schema), "--json", "--temperature", "0.8", "--seed", "3"]
    assert main(sampled) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "grammar" and out["valid"] and "sampled" in out["fallback_reason"]
    validate(out["value"], SCHEMAS["flat"])
    assert main(sampled) == 0
    assert json.loads(capsys.readouterr().out)["text"] == out["text"]
    with pytest.raises(TypeError):
        generate_json(model, tok, PROMPT, SCHEMAS["flat"], temperature=0.8)


def test_default_tokenizer_scaffold_tokenizes_as_the_whole_text():
    """With the shipped model's tokenizer, the region (scaffold + committed slots) is exactly the
    tokenization of the JSON text, for every schema above."""
    from clover.api import DEFAULT_MODEL

    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("no default model")
    model, tok = clover.load(device="cpu")
    for name, schema in SCHEMAS.items():
        out = generate_json(model, tok, PROMPT, schema, chat=True)
        assert out.valid, name
        _assert_tokens_as_whole_text(tok, out, schema)


def _biased_grammar(model, tok, schema, favourite, max_new_tokens: int):
    """The grammar path's document when the model favours the tokens whose text passes `favourite`."""
    handle = _bias(model, [i for t, i in tok.get_vocab().items() if favourite(t.strip("Ġ"))])
    try:
        return generate_json(model, tok, PROMPT, schema, method="grammar", max_new_tokens=max_new_tokens)
    finally:
        handle.remove()


def test_grammar_path_keeps_the_keywords_beside_an_anyof(tiny):
    """xgrammar reads an anyOf alone (its siblings ignored: SchemaStore's taskfile came out as the
    number 82); for_decoding folds the siblings into every branch, so a model that wants digits
    still writes the object the schema asks for (regression: the final check used to reject it)."""
    import xgrammar as xgr

    from clover.structured.grammar import compile_schema
    from clover.structured.normalize import for_decoding

    model, tok = tiny
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "additionalProperties": False, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
    decodable = for_decoding(schema)
    assert set(decodable) == {"anyOf"} and all(b["type"] == "object" for b in decodable["anyOf"])
    as_one_of = {k: v for k, v in schema.items() if k != "anyOf"} | {"oneOf": schema["anyOf"]}
    for s in (schema, as_one_of):
        matcher = xgr.GrammarMatcher(compile_schema(tok, model.config.vocab_size, (tok.eos_token_id,), s))
        assert not matcher.accept_string("82")
    out = _biased_grammar(model, tok, schema, str.isdigit, 40)
    assert out.complete and out.valid, (out.text, out.error)
    assert isinstance(out.value, dict) and ("a" in out.value or "b" in out.value)


@pytest.mark.parametrize("fmt", ["email", "date-time", "date", "time", "uri", "uuid", "ipv4", "ipv6", "hostname"])
def test_grammar_path_formats_end_within_a_small_budget(tiny, fmt):
    """xgrammar ignores maxLength next to a format, so a formatted string need never end; for_decoding
    writes the format as a bounded pattern: even a model that wants letters and digits for ever ends
    the value (within maxLength) and the final check, format included, accepts it."""
    model, tok = tiny
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt, "maxLength": 40}},
              "required": ["v"]}
    out = _biased_grammar(model, tok, schema, str.isalnum, 60)
    assert out.complete and out.valid, (out.text, out.error)
    assert 1 <= len(out.value["v"]) <= 40
    validators = pytest.importorskip("jsonschema").validators
    from jsonschema import FormatChecker
    assert validators.validator_for(schema)(schema, format_checker=FormatChecker()).is_valid(out.value)


def test_patterns_are_bounded_for_the_grammar(tiny):
    """xgrammar ignores maxLength next to a pattern too (SchemaStore's GitHub assignee,
    `^[a-zA-Z0-9](-?[a-zA-Z0-9])*$` with maxLength 39, came out hundreds of characters long):
    for_decoding bounds the pattern's repeats. The bounded pattern matches only what the original
    matches, within maxLength, and a model that wants letters for ever ends the value."""
    import re

    from clover.structured.normalize import _width, bounded_pattern

    rng = random.Random(0)
    cases = [(r"^[a-zA-Z0-9](-?[a-zA-Z0-9])*$", 39), (r"^[a-z]+$", 7), (r"[*+]a+b*", 20), (r"\+\d{2,}x*?", 12),
             (r"^[^]a]+$", 5), (r"^(0|[1-9]\d*)(?:\.(0|[1-9]\d*))?$", 11)]
    for pattern, n in cases:
        bounded = bounded_pattern(pattern, n)
        assert bounded != pattern and _width(bounded) <= n, (pattern, bounded)
        for _ in range(300):
            text = "".join(rng.choice("ab-+*.0123x]") for _ in range(rng.randint(0, 14)))
            if re.search(bounded, text):
                assert re.search(pattern, text), (pattern, bounded, text)
    assert bounded_pattern("^a{3}$", 2) == "^a{3}$" and bounded_pattern("^a+$", 100) == "^a{1,16}$"
    model, tok = tiny
    schema = {"type": "object", "properties": {"v": {"type": "string", "maxLength": 9, "pattern": "^[a-z](-?[a-z0-9])*$"}},
              "required": ["v"]}
    out = _biased_grammar(model, tok, schema, str.isalnum, 40)
    assert out.complete and out.valid and 1 <= len(out.value["v"]) <= 9, (out.text, out.error)


def test_grammar_path_bounds_the_digits_of_numbers(tiny):
    """xgrammar lets an integer or number without both bounds run to any number of digits (pydantic's
    Trip and SchemaStore's citation-file-format ran out of max_tokens); for_decoding gives it both
    bounds, so a model that wants digits for ever ends the value and the document."""
    from clover.structured.normalize import for_decoding

    model, tok = tiny
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5}, "x": {"type": "number"},
                                               "k": {"type": ["integer", "null"], "exclusiveMaximum": -2}},
              "required": ["n", "x", "k"], "additionalProperties": False}
    props = for_decoding(schema)["properties"]
    assert props["n"]["minimum"] == 5 and props["n"]["maximum"] > 5
    assert props["x"]["minimum"] < 0 < props["x"]["maximum"]
    assert props["k"]["exclusiveMaximum"] == -2 and props["k"]["minimum"] < -2 and "maximum" not in props["k"]
    out = _biased_grammar(model, tok, schema, str.isdigit, 120)
    assert out.complete and out.valid, (out.text, out.error)


def test_grammar_path_applies_the_keywords_beside_a_ref(tiny):
    """xgrammar reads a `$ref` alone (`{"$ref": <integer>, "maximum": 3}` accepted 7): for_decoding
    merges the target with the siblings."""
    import xgrammar as xgr

    from clover.structured.grammar import compile_schema

    model, tok = tiny
    schema = {"$ref": "#/$defs/a", "maximum": 3, "minimum": 0, "$defs": {"a": {"type": "integer"}}}

    def accepts(text):
        return xgr.GrammarMatcher(compile_schema(tok, model.config.vocab_size, (tok.eos_token_id,), schema)).accept_string(text)
    assert accepts("3") and not accepts("7")
    inner = {k: v for k, v in schema.items() if k != "$defs"}
    doc = {"type": "object", "properties": {"v": inner}, "required": ["v"], "$defs": schema["$defs"]}
    out = _biased_grammar(model, tok, doc, str.isdigit, 30)
    assert out.complete and out.valid and 0 <= out.value["v"] <= 3, (out.text, out.error)


def test_grammar_path_compiles_arrays_with_min_items_and_no_items(tiny):
    """`{"type": "array", "minItems": 1}` (GitHub workflows, GitLab CI, the draft-04 meta-schema):
    xgrammar's strict mode allows no items there and refused to compile it; for_decoding gives it
    bounded scalar items, and the decoded array has at least minItems of them."""
    model, tok = tiny
    schema = {"type": "object", "properties": {"a": {"type": "array", "minItems": 2}}, "required": ["a"]}
    out = _biased_grammar(model, tok, schema, str.isalnum, 120)
    assert out.complete and out.valid and len(out.value["a"]) >= 2, (out.text, out.error)


def test_patterns_with_raw_control_characters_compile(tiny):
    """GitHub actions' expression pattern holds a raw CR and LF in a character class, which
    xgrammar's lexer rejects (the whole document was refused); for_decoding writes them as escapes,
    the same regular expression."""
    import re

    from clover.structured.normalize import escape_controls

    pattern = "^\\$\\{\\{(.|[\r\n])*\\}\\}$"
    assert escape_controls(pattern) == "^\\$\\{\\{(.|[\\r\\n])*\\}\\}$"
    for p in ("a[\r\n]b", "a\\\nb", "x\x01y", "\\\\\n"):
        for text in ("a\nb", "a\rb", "x\x01y", "\\\n", "a\\nb", "\\n"):
            assert bool(re.search(p, text)) == bool(re.search(escape_controls(p), text)), (p, text)
    model, tok = tiny
    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern, "maxLength": 20}},
              "required": ["v"]}
    out = _biased_grammar(model, tok, schema, str.isalnum, 60)
    assert out.complete and out.valid and out.value["v"].startswith("${{"), (out.text, out.error)


WIDE = {"type": "object", "required": ["id", "steps"], "properties": {
    "id": {"type": "string", "minLength": 2},
    "steps": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["run"], "properties": {
        "run": {"type": "string"}, "env": {"type": "object", "additionalProperties": {"type": "string"}},
        "with": {"type": "array", "items": {"type": "string"}}}}},
    **{f"opt{i}": {"type": "string"} for i in range(6)},
    "labels": {"type": "array", "items": {"type": "string"}, "minItems": 1}}}


def test_grammar_path_ends_within_the_budget_by_its_caps(tiny):
    """A wide schema of free strings, arrays and maps (SchemaStore's CI files) under a model that
    wants letters for ever: for_decoding's caps alone let the document outgrow a small budget (cut);
    the grammar path starts at the LADDER level whose estimated size fits, climbing down on a cut,
    so the document ends valid within max_tokens, the schema's own minimums kept."""
    from clover.structured import grammar

    model, tok = tiny
    budget = 70
    assert grammar.size(grammar.decodable(WIDE)) > grammar.CHARS_PER_TOKEN * budget  # caps alone do not fit
    out = _biased_grammar(model, tok, WIDE, str.isalpha, budget)
    assert out.complete and out.valid and out.note is None, (out.text, out.error)
    assert len(out.token_ids) <= budget and out.forward_passes <= budget * len(grammar.LADDER)
    assert len(out.value["id"]) >= 2 and len(out.value["steps"]) >= 1 and len(out.value.get("labels", [0])) >= 1
    old = grammar.LADDER
    try:  # the reference: for_decoding's caps only, as before the ladder; the same model runs out
        grammar.LADDER = (None,)
        cut = _biased_grammar(model, tok, WIDE, str.isalpha, budget)
    finally:
        grammar.LADDER = old
    # the model's try was cut: the smallest valid document stands in (never a cut one)
    assert cut.complete and cut.valid and "cut by max_tokens" in cut.note and len(cut.token_ids) <= budget


@pytest.mark.parametrize("seed", range(3))
def test_every_ladder_level_keeps_the_schema_and_its_size_bound(tiny, seed):
    """`tighten` only lowers bounds to the schema's own minimums and leaves out what is optional:
    sampled documents at every LADDER level validate against the original schema, and are no longer
    than `size` estimates (the bound start_level reads)."""
    from clover.structured import grammar
    from clover.structured.normalize import normalize

    model, tok = tiny
    schema = normalize({"type": "object", "minProperties": 2, "properties": {
        "a": {"type": "string", "minLength": 3}, "b": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
        "c": {"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 1},
        "d": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
        "e": {"type": "array", "prefixItems": [{"type": "boolean"}], "items": {"type": "string"}}}, "required": ["c"]})
    ids = clover.api.encode(tok, PROMPT)
    for caps in grammar.LADDER:
        compiled = grammar.compile_schema(tok, model.config.vocab_size, clover.api.eos_ids(model, tok), schema, caps)
        out = grammar._decode(model, tok, ids, schema, "", "", 400, torch.Generator().manual_seed(seed), compiled)
        assert out.complete and out.valid, (caps, out.text, out.error)
        assert len(out.text) <= grammar.size(grammar.decodable(schema, caps)), (caps, out.text)
    minimal = grammar.decodable(schema, grammar.LADDER[-1])
    assert minimal["properties"].keys() == {"c", "a"}  # required, and one more for minProperties


def test_optional_groups_keep_the_regex_and_xgrammar_reads_them_right():
    """xgrammar 0.2 compiles `(...)?` around a repeat wrongly (`^b(@.{1,2})?$` accepted "bx");
    `_optional_groups` writes it `{0,1}`: the same language as the original by Python's re on random
    strings, and what xgrammar then accepts is what re matches."""
    import re

    import xgrammar as xgr

    from clover.structured.grammar import _optional_groups

    rng = random.Random(0)
    patterns = [r"^b(@.{1,2})?$", r"^(.+\/)+(.+)\.(ya?ml)(@.+)?$", r"^a(b|c)?d$", r"^(?:x[0-9]+)?y$",
                r"^[)?]+(z)??$", r"^\)?q(\?)?$"]
    for p in patterns:
        q = _optional_groups(p)
        g = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": q}), strict_mode=True)
        for _ in range(60):
            s = "".join(rng.choice("b@xy/.ymlacdz0?)q") for _ in range(rng.randint(0, 8)))
            assert bool(re.search(p, s)) == bool(re.search(q, s)), (p, q, s)
            assert xgr.testing._is_grammar_accept_string(g, json.dumps(s)) == bool(re.search(p, s)), (p, s)
    assert _optional_groups(r"^b(@.{1,2})?$") == r"^b(@.{1,2}){0,1}$"


FORM_ITEM = {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["markdown", "input", "other"]}},
             "allOf": [
                 {"if": {"properties": {"type": {"const": "markdown"}}},
                  "then": {"required": ["type", "value"], "properties": {"type": {"enum": ["markdown", "input", "other"]},
                                                                        "value": {"type": "string", "minLength": 1}},
                           "additionalProperties": False}},
                 {"if": {"properties": {"type": {"const": "input"}}},
                  "then": {"required": ["type", "label"], "properties": {"type": {"enum": ["markdown", "input", "other"]},
                                                                        "label": {"type": "integer", "minimum": 3}},
                           "additionalProperties": False}}]}


@pytest.mark.parametrize("seed", range(4))
def test_conditionals_keyed_on_a_const_decode_valid(tiny, seed):
    """An allOf of if/then parts keyed on one property (GitHub's issue forms): for_decoding alone
    cannot make both `if`s hold and drops them, so documents missed the `then`s; `conditionals`
    writes the parts as cases, and every sampled document validates."""
    from clover.structured import grammar
    from clover.structured.normalize import normalize

    model, tok = tiny
    schema = normalize(FORM_ITEM)
    cases = grammar.conditionals(schema)
    assert "if" not in json.dumps(cases) and len(cases["allOf"][-1]["anyOf"]) == 2
    compiled = grammar.compile_schema(tok, model.config.vocab_size, clover.api.eos_ids(model, tok), schema)
    out = grammar._decode(model, tok, clover.api.encode(tok, PROMPT), schema, "", "", 120,
                          torch.Generator().manual_seed(seed), compiled)
    assert out.complete and out.valid, (out.text, out.error)
    assert out.value["type"] in ("markdown", "input")


def test_a_recursion_through_a_ref_with_siblings_is_bounded(tiny):
    """`unroll` bounds bare $refs; one beside other keywords is expanded by for_decoding, which
    nested without end (renovate's config: a RecursionError, a 500). It now stops after RECURSION
    expansions of one target, leaving the deeper optional property out, and the document is valid."""
    from clover.structured.normalize import RECURSION, for_decoding, normalize, unroll

    model, tok = tiny
    schema = normalize({"$defs": {"node": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"$ref": "#/$defs/node", "maxProperties": 2}}}}, "$ref": "#/$defs/node", "minProperties": 1})
    decodable = for_decoding(unroll(schema))
    depth, s = 0, decodable
    while "next" in s.get("properties", {}):
        depth, s = depth + 1, s["properties"]["next"]
    assert 1 <= depth <= RECURSION + 1
    out = _biased_grammar(model, tok, schema, lambda t: t in ('"', "next", "{", ":", ","), 120)
    assert out.complete and out.valid, (out.text, out.error)


# ---- issue 53: satisfiable schemas answered, documents never cut, compiles bounded ---------------------------
UNDECLARED = {"type": "object", "required": ["title"], "properties": {"titles": {"type": "string"}}}
MAP_REQUIRED = {"type": "object", "additionalProperties": {"type": "string"}, "required": ["a", "b", "c", "d"]}
NEVER_OPTIONAL = {"type": "object", "properties": {"b": {"type": "object", "enum": ["x"]}, "c": {"type": "boolean"}}}


@pytest.mark.parametrize("method", ["auto", "grammar"])
@pytest.mark.parametrize("schema", [UNDECLARED, MAP_REQUIRED, NEVER_OPTIONAL], ids=["undeclared", "map", "never"])
def test_satisfiable_schemas_give_valid_documents(tiny, schema, method):
    """A required key `properties` does not declare takes any value (it used to be a 500), a map's
    required keys may outnumber its cap (a false 400 from the grammar library), an optional property
    no value satisfies is left out (a false 400): a valid document, infilled or under the grammar."""
    from jsonschema import validate as check

    model, tok = tiny
    out = generate_json(model, tok, PROMPT, schema, max_new_tokens=120, method=method)
    assert out.valid and out.complete, (out.method, out.text, out.error)
    check(out.value, schema)
    assert set(schema.get("required", [])) <= set(out.value)
    assert schema is not NEVER_OPTIONAL or "b" not in out.value


def test_unsatisfiable_schemas_are_refused_naming_the_keyword(tiny):
    from clover.structured.grammar import decodable
    from clover.structured.normalize import Refused, normalize

    model, tok = tiny
    closed = {"type": "object", "required": ["a"], "properties": {"b": {}}, "additionalProperties": False}
    with pytest.raises(Refused, match="'required' at #: 'a' is required"):
        decodable(normalize(closed))
    with pytest.raises(ValueError, match="additionalProperties is false"):
        generate_json(model, tok, PROMPT, closed)
    with pytest.raises(Refused, match="'enum' at #/properties/b: no value"):  # required: nothing to leave out
        decodable(normalize(NEVER_OPTIONAL | {"required": ["b"]}))


@pytest.mark.parametrize("seed", range(40))
def test_the_smallest_document_is_valid_and_no_longer_than_the_sampled_ones(tiny, seed):
    """smallest_text on random schemas (the reference: documents sampled under the tightest grammar,
    validated by jsonschema): when it builds one it is valid, and never longer than a sampled one."""
    from clover.structured import grammar
    from clover.structured.normalize import normalize
    from clover.structured.smallest import smallest_text

    model, tok = tiny
    rng = random.Random(seed)
    schema = normalize(_random_schema(rng, 3))
    tight = grammar.decodable(schema, grammar.LADDER[-1])
    text = smallest_text(tight, schema)
    compiled = grammar.compile_schema(tok, model.config.vocab_size, clover.api.eos_ids(model, tok), schema,
                                      grammar.LADDER[-1])
    sampled = grammar._decode(model, tok, clover.api.encode(tok, PROMPT), schema, "", "", 300,
                              torch.Generator().manual_seed(seed), compiled)
    if text is not None:
        from jsonschema import validate as check

        check(json.loads(text), schema)
        if sampled.valid:
            assert len(text) <= len(json.dumps(sampled.value, ensure_ascii=False)), (text, sampled.text)


def _random_schema(rng, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "null", "enum"] + (["object", "array", "anyOf"] if depth else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return rng.choice([{"type": "string"}, {"type": "string", "minLength": rng.randint(0, 4)},
                           {"type": "string", "pattern": rng.choice(["^[a-z]{2,5}$", "^x-", "^[0-9]+(\\.[0-9]+)?$"])},
                           {"type": "string", "format": rng.choice(["date", "uuid", "email"])}])
    if kind in ("integer", "number"):
        s = {"type": kind}
        if rng.random() < 0.6:
            s[rng.choice(["minimum", "exclusiveMinimum"])] = rng.randint(-5, 7)
        if rng.random() < 0.5:
            s["maximum"] = s.get("minimum", s.get("exclusiveMinimum", 0)) + rng.randint(2, 30)
        if rng.random() < 0.3:
            s["multipleOf"] = rng.choice([2, 5])
        return s
    if kind == "enum":
        return {"enum": rng.sample(["a", "bb", 3, None, True, "cccc"], rng.randint(1, 4))}
    if kind == "object":
        props = {f"k{i}": _random_schema(rng, depth - 1) for i in range(rng.randint(0, 4))}
        return {"type": "object", "properties": props, "required": [k for k in props if rng.random() < 0.5]}
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth - 1), "minItems": rng.randint(0, 2)}
    if kind == "anyOf":
        return {"anyOf": [_random_schema(rng, depth - 1) for _ in range(2)]}
    return {"type": kind}


def test_pattern_min_matches_its_pattern():
    from clover.structured.smallest import pattern_min

    for pattern in ("^/", "^[a-z]+$", "^([0-9]{3})$|^(default)$", "^x-", "^[^{}/ :\\\\]{1,16}(?::\\d{1,16})?$",
                    "^\\$\\{\\{(.|[\\r\\n])*\\}\\}$", "a|bc", "[A-Z][a-z]{2}\\d"):
        text = pattern_min(pattern)
        assert text is not None and re.search(pattern, text), (pattern, text)
    assert pattern_min("^(?=ab)a$") is None  # a lookahead the layout cannot honour: None, never a wrong string
    assert pattern_min("^(a)\\1$") is None


def test_a_slow_grammar_compile_is_stopped_and_refused(tiny, monkeypatch):
    """A compile past its time is stopped (the worker process killed) and the request refused, naming
    the budget; a compile within it gives the same grammar as one in this process."""
    import xgrammar as xgr

    from clover.structured import compiler, grammar
    from clover.structured.normalize import Refused, normalize

    model, tok = tiny
    props = {f"slow{i}": {"type": "array", "minItems": 1, "items": {
        "type": "object", "additionalProperties": {"type": "string", "pattern": "^[a-z]+$"}}} for i in range(12)}
    schema = normalize({"type": "object", "properties": props, "required": list(props)})  # no level seen before
    monkeypatch.setattr(grammar, "IN_PROCESS_CHARS", 0)  # every compile in the worker
    monkeypatch.setattr(grammar, "COMPILE_SECONDS", 0.0)
    with pytest.raises(Refused, match="did not compile within the grammar path.s 0 s"):
        generate_json(model, tok, PROMPT, schema, method="grammar", max_new_tokens=300)
    assert not compiler._WORKER  # stopped
    monkeypatch.setattr(grammar, "COMPILE_SECONDS", 60.0)
    out = generate_json(model, tok, PROMPT, schema, method="grammar", max_new_tokens=300)
    assert out.valid and compiler._WORKER and compiler._WORKER[0].proc.poll() is None
    stops = clover.api.eos_ids(model, tok)
    remote = grammar.compile_schema(tok, model.config.vocab_size, stops, {"type": "string", "pattern": "^[ab]{2}$"})
    for text, ok in (('"ab"', True), ('"ba"', True), ('"abc"', False), ('"c"', False)):
        assert xgr.GrammarMatcher(remote).accept_string(text) == ok


def test_grammar_library_errors_name_no_internal_path():
    from clover.structured.grammar import _keyword, clean_message

    raw = "[11:58:51] /project/cpp/json_schema_converter.cc:5082: maxProperties is less than the number of " \
          "required properties: 1 < 2\n"
    clean = clean_message(raw)
    assert clean == "maxProperties is less than the number of required properties: 1 < 2"
    assert _keyword(clean) == "maxProperties" and "/" not in clean_message("[1:2:3] C:\\x\\regex.cc:9: bad")


def test_an_anyof_branch_no_value_satisfies_is_left_out(tiny):
    """A branch whose required property no value satisfies is left out of the anyOf (was a refusal of
    the whole schema: SchemaStore's GitHub action `runs`); none left is Refused naming `enum`."""
    from clover.structured.grammar import decodable
    from clover.structured.normalize import Refused, normalize

    model, tok = tiny
    dead = {"type": "object", "required": ["k"], "properties": {"k": {"type": "integer", "enum": ["a"]}}}
    live = {"type": "object", "required": ["v"], "properties": {"v": {"type": "boolean"}}}
    schema = {"anyOf": [dead, live]}
    assert decodable(normalize(schema))["anyOf"][0]["required"] == ["v"]
    out = generate_json(model, tok, PROMPT, schema, max_new_tokens=60)
    assert out.valid and "v" in out.value
    with pytest.raises(Refused, match="'enum' at #/anyOf/0/properties/k"):
        decodable(normalize({"anyOf": [dead, dead | {"required": ["k"]}]}))


def test_a_schema_that_expands_without_end_is_refused_quickly(monkeypatch):
    """for_decoding lays out at most MAX_NODES subschemas (renovate's config expanded for 25 minutes):
    TooLarge past it, never swallowed as an optional part left out."""
    import importlib

    from clover.structured.grammar import decodable

    norm = importlib.import_module("clover.structured.normalize")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "object", "properties": {
        f"q{j}": {"type": "string"} for j in range(30)}} for i in range(30)}}
    assert decodable(norm.normalize(wide))
    monkeypatch.setattr(norm, "MAX_NODES", 200)
    with pytest.raises(norm.TooLarge, match="more than 200 subschemas"):
        decodable(norm.normalize(wide | {"required": []}))  # another schema: not the cached one


def test_json_object_numbers_never_overflow_to_infinity(tiny):
    """json_object's numbers are bounded in its grammar (a model that wants digits and exponents
    cannot write `8888E88888`, which Python reads as inf and no encoder writes back as JSON), and
    the grammar path's parse refuses a number that overflows whatever the grammar let through."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from clover.structured.grammar import decodable, finite_loads

    grammar = xgr.Grammar.from_json_schema(json.dumps(decodable({"type": "json_object"})))
    assert accepts(grammar, '{"a": 12, "b": -3.25}')
    assert not accepts(grammar, '{"a": 8888E88888}') and not accepts(grammar, '{"a": 1' + "0" * 400 + "}")
    model, tok = tiny
    out = _biased_grammar(model, tok, {"type": "json_object"}, lambda t: t and all(c in "0123456789eE+-." for c in t),
                          200)
    assert out.complete and out.valid, (out.text, out.error)
    assert all(math.isfinite(v) for v in out.value.values() if isinstance(v, float)), out.text
    assert json.loads(json.dumps(out.value, allow_nan=False)) == out.value
    with pytest.raises(ValueError, match="overflows to infinity"):
        finite_loads('{"a": 8888E88888}')
    assert finite_loads('{"a": 1.5e3, "b": 7}') == {"a": 1500.0, "b": 7}


def test_kept_token_ids_and_smallest_documents_equal_fresh_ones():
    """infill.token_ids and grammar.smallest_document keep their answers per tokenizer: equal to a fresh
    computation, handed out as copies (a caller's edit does not reach the next caller)."""
    from clover.engine import infill
    from clover.structured import grammar

    tok = tiny_tokenizer()
    for text in ['{"city": "', ', "b": ', "x" * (infill.SHORT + 5)]:
        first = infill.token_ids(tok, text)
        first.append(-1)
        assert infill.token_ids(tok, text) == tok(text, add_special_tokens=False).input_ids
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    want = grammar._smallest_document(tok, schema, "<c>", "</c>")
    got = grammar.smallest_document(tok, schema, "<c>", "</c>")
    got[1].append(-1)
    assert grammar.smallest_document(tok, schema, "<c>", "</c>") == want and want is not None
