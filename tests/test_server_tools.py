"""OpenAI function calling in `clover serve`: `tools` / `tool_choice` / `parallel_tool_calls` in,
`tool_calls` out (streamed and not), driven by the official `openai` client against a tiny random model
with a real Clover tokenizer (byte-level BPE, atomic <tool_call> tokens, the chat template that renders
tools); plus the reply assembly on given generated text (parsing, malformed calls), forced
calls and `response_format` by schema-guided infilling or the grammar path (docs/structured.md); the
corpus-level checks (BFCL-style tools, pydantic models through `parse`) are in test_structured_corpus.py,
parallel forced calls and the openai client's `parse` in test_server_tools_openai.py."""

import json
import re

import openai
import pytest
from jsonschema import validate

from clover.api import eos_ids
from clover.chat import render_chat
from clover.server import Settings, create_app
from clover.server.app import Choice
from clover.server.protocol import ToolPlan
from server_utils import TOOL_ASK, TOOL_CALL, WEATHER, RunningServer, raw, tools_server_fixtures

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK, CALL = TOOL_ASK, TOOL_CALL


loaded, server, client = tools_server_fixtures("tools-model")


def plan(choice="auto", tools=(WEATHER, TIME), parallel=True) -> ToolPlan:
    tools = list(tools)
    return ToolPlan(tools, [t["function"] for t in tools], choice, parallel)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


# ---- the reply assembly on given generated text --------------------------------------------------------
def test_auto_reply_parses_calls_and_keeps_the_rest():
    text = "Let me look.\n" + CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, calls, finish = plan().reply(text, "stop")
    assert content == "Let me look." and finish == "tool_calls"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    content, calls, finish = plan(parallel=False).reply(text, "stop")
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and content == "Let me look."
    assert plan().reply(CALL, "stop")[0] is None  # nothing but calls: content null


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',  # not JSON
    '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',  # not among the tools
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # never closed
])
def test_malformed_calls_are_content(bad):
    content, calls, finish = plan().reply("Hmm. " + bad, "stop")
    assert calls == [] and finish == "stop" and content == ("Hmm. " + bad).strip()
    assert plan("none").reply(CALL, "stop") == (CALL, [], "stop")  # none: never parsed


def test_streamed_content_stops_at_the_call_and_matches_the_reply(loaded):
    _, tokenizer = loaded
    text = "  Let me look.\n" + CALL + "\nbye <tool_call> broken"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    choice = Choice(tokenizer, [], False, plan())
    sent = ""
    for n in range(1, len(ids) + 1):
        choice.update(ids[:n], "stop" if n == len(ids) else None)
        sent += choice.deltas()[1]
        if not choice.done:
            assert "<" not in sent  # the call (or a possible start of one) is never streamed as content
    assert sent == choice.content == "Let me look.\n\nbye <tool_call> broken"
    assert [c["function"]["name"] for c in choice.tool_calls] == ["get_weather"]
    assert choice.finish_reason == "tool_calls" and choice.message()["tool_calls"] == choice.tool_calls


# ---- the live server with the openai client --------------------------------------------------------------
def calls_of(message):
    return [(c.type, c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("tools,choice", [([WEATHER, TIME], NAMED), ([WEATHER], "required")],
                         ids=["named", "required-one-tool"])
def test_forced_call_non_stream_and_stream(client, tools, choice):
    kw = dict(model="tiny", messages=ASK, tools=tools, tool_choice=choice, max_tokens=64)
    one = client.chat.completions.create(**kw)
    msg, finish = one.choices[0].message, one.choices[0].finish_reason
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather"
    assert msg.tool_calls[0].id.startswith("call_") and finish == "tool_calls"  # never a cut call
    # the stream helpers of the official client reassemble the same call (read the events and the snapshot)
    with client.chat.completions.stream(**kw) as stream:
        done = [(e.index, e.name, e.arguments) for e in stream if e.type == "tool_calls.function.arguments.done"]
        snapshot = stream.current_completion_snapshot
    assert calls_of(snapshot.choices[0].message) == calls_of(msg) and snapshot.choices[0].finish_reason == finish
    assert done == [(0, "get_weather", msg.tool_calls[0].function.arguments)]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    heads = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or [] if tc.id]
    assert [(h.index, h.type, h.function.name) for h in heads] == [(0, "function", "get_weather")]
    assert chunks[-1].choices[0].finish_reason == finish


def test_forced_calls_are_infilled_and_valid_for_their_schema(client):
    """Forced calls are infilled (server/structured.py): the function is an options slot over the
    tools' names, the arguments follow the function's parameters schema, whatever the model."""
    from jsonschema import validate

    specs = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in ("required", NAMED, {"type": "function", "function": {"name": "get_time"}}):
        one = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                             max_tokens=64)  # the call frame counts: 16 would cut it ("length")
        (call,) = one.choices[0].message.tool_calls
        assert one.choices[0].finish_reason == "tool_calls" and call.function.name in specs
        validate(json.loads(call.function.arguments), specs[call.function.name])
        info = one.model_extra["clover"]["structured"][0]
        assert info["method"] == "infill" and info["valid"]
        # one forward at least per open value (the function's name under "required", the city); a named
        # call without arguments is all scaffold: no forward at all
        assert (info["forward_passes"] == 0) == (choice != "required" and call.function.name == "get_time")


def test_auto_and_none_stream_like_non_stream(client, loaded):
    _, tokenizer = loaded
    for choice in ("auto", "none"):
        kw = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=24)
        one = client.chat.completions.create(**kw)
        text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**kw, stream=True))
        assert text == (one.choices[0].message.content or "")
        if choice == "none":
            assert one.choices[0].message.tool_calls is None and one.choices[0].finish_reason in ("stop", "length")
    # the tools are rendered into the prompt (also under "none")
    prompt = render_chat(ASK, add_generation_prompt=True, enable_thinking=False, tools=[WEATHER])
    assert one.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)


class ScriptedText:
    """The tokenizer, except that a reply of n tokens decodes to the first n/N of SCRIPT: the live server
    path (blocks, stream chunks, the official client's helpers) with a reply a random model never writes."""
    SCRIPT = "Checking.\n" + CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    N = 24

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kw):
        return self.tokenizer(*args, **kw)

    def decode(self, ids, **kw):
        return self.SCRIPT[: len(self.SCRIPT) * min(len(ids), self.N) // self.N]


def test_auto_calls_through_the_live_stream(loaded):
    model, tokenizer = loaded
    settings = Settings(model_id="tiny", block_size=4, threshold=0.5)
    with RunningServer(create_app(model, ScriptedText(tokenizer), settings, eos_ids(model, tokenizer))) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        kw = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=ScriptedText.N,
                  extra_body={"ignore_eos": True})
        one = c.chat.completions.create(**kw)
        msg = one.choices[0].message
        assert msg.content == "Checking." and one.choices[0].finish_reason == "tool_calls"
        assert [(n, json.loads(a)) for _, n, a in calls_of(msg)] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
        with c.chat.completions.stream(**kw) as stream:
            final = stream.get_final_completion()
        assert final.choices[0].message.content == "Checking." and calls_of(final.choices[0].message) == calls_of(msg)
        chunks = [ch.choices[0] for ch in c.chat.completions.create(**kw, stream=True)]
        text = "".join(ch.delta.content or "" for ch in chunks)
        parts = [(tc.index, tc.id is not None, tc.function.name, tc.function.arguments)
                 for ch in chunks for tc in ch.delta.tool_calls or []]
        assert text == "Checking." and chunks[-1].finish_reason == "tool_calls"
        assert [(i, head, name) for i, head, name, _ in parts] == [
            (0, True, "get_weather"), (0, False, None), (1, True, "get_time"), (1, False, None)]
        only = c.chat.completions.create(**kw, parallel_tool_calls=False).choices[0].message
        assert [n for _, n, _ in calls_of(only)] == ["get_weather"]
        none = c.chat.completions.create(**kw | {"tool_choice": "none"}).choices[0]
        assert none.message.content == ScriptedText.SCRIPT and none.message.tool_calls is None
        assert none.finish_reason == "length"


def test_round_trip_with_a_tool_result(client, loaded):
    _, tokenizer = loaded
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=64)
    msg = first.choices[0].message
    result = {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp_c": 21}'}
    written = {"role": "assistant", "content": None, "tool_calls": [  # as a client writes it by hand
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    for history in (ASK + [msg.model_dump(exclude_none=True), result], ASK + [written, result | {"tool_call_id": "call_1"}]):
        second = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=8)
        assert second.choices[0].message.role == "assistant"
        prompt = render_chat(history, add_generation_prompt=True, enable_thinking=False, tools=[WEATHER])
        assert "<tool_response>\n{\"temp_c\": 21}\n</tool_response>" in prompt
        assert second.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)


def _fn(name="f", params=None):
    fn = {"name": name}
    if params is not None:
        fn["parameters"] = params
    return {"type": "function", "function": fn}


BAD = [
    # (what, extra request fields, param named by the error)
    ("not a function tool", {"tools": [{"type": "retrieval"}]}, "tools"),
    ("tools not a list", {"tools": "get_weather"}, "tools"),
    ("bad function name", {"tools": [_fn("get weather!")]}, "tools"),
    ("missing function name", {"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools"),
    ("duplicate names", {"tools": [_fn("f"), _fn("f")]}, "tools"),
    ("parameters not an object schema", {"tools": [_fn("f", {"type": "array"})]}, "tools"),
    ("unknown tool_choice name", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("bad tool_choice", {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ("tool_choice without tools", {"tool_choice": "auto"}, "tool_choice"),
    ("tool message without its id", {"messages": ASK + [{"role": "tool", "content": "21"}]}, "messages.1.tool_call_id"),
]


@pytest.mark.parametrize("what,fields,param", BAD, ids=[b[0] for b in BAD])
def test_bad_tools_are_400(client, what, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{"model": "tiny", "messages": ASK, "max_tokens": 4, **fields})
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == param and body["message"], body


# ---- response_format: json_schema infilled, json_object / other schemas generated and checked ------------
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Rome"]}, "pets": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                  "maxItems": 3},
    "home": {"type": "object", "properties": {"owner": {"type": "boolean"}, "rooms": {"type": "number"}}}},
    "required": ["name", "age"]}


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


@pytest.mark.parametrize("schema", [PERSON, {"type": "object", "properties": {"ok": {"type": "boolean"}}},
                                    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}],
                         ids=["nested", "flat", "array"])
def test_json_schema_is_infilled_and_valid(client, schema):
    from jsonschema import validate

    kw = dict(model="tiny", messages=ASK, response_format=schema_format(schema), max_tokens=160)
    one = client.chat.completions.create(**kw)
    from jsonschema import validate
    validate(json.loads(one.choices[0].message.content), schema)
    assert one.choices[0].finish_reason == "stop"
    info = one.model_extra["clover"]["structured"][0]
    assert info["method"] == "infill" and info["valid"] and info["forward_passes"] >= 1
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == one.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fmt,why", [({"type": "json_object"}, "json_object"),
                                     (schema_format({"anyOf": [{"type": "string"}, {"type": "integer"}]}), "anyOf"),
                                     (schema_format({"type": "object", "properties": {
                                         "d": {"type": "string", "format": "date"},
                                         "tags": {"type": ["string", "null"]}}, "required": ["d"]}), "format")])
def test_other_formats_take_the_grammar_path_and_are_valid(client, fmt, why):
    from jsonschema import FormatChecker, validate

    one = client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=200)
    info = one.model_extra["clover"]["structured"][0]
    assert info["method"] == "grammar" and info["valid"] and one.choices[0].finish_reason == "stop"
    value = json.loads(one.choices[0].message.content)  # the content itself is the document
    if fmt["type"] == "json_object":
        assert isinstance(value, dict)
    else:
        validate(value, fmt["json_schema"]["schema"], format_checker=FormatChecker())
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=200,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == one.choices[0].message.content
    assert chunks[-1].model_extra["clover"]["structured"] == info


def test_a_document_that_cannot_fit_max_tokens_is_refused_before_decoding(client, server):
    """Never a cut document (issue 53): when even the smallest valid document cannot fit max_tokens the
    request is a 400 naming max_tokens and the tokens it needs (official client and raw HTTP); with
    that many tokens the reply is a complete, valid document."""
    fmt = schema_format({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]{40}$"}},
                         "required": ["a"]})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=6)
    assert e.value.body["param"] == "max_tokens" and "max_tokens (6)" in e.value.body["message"]
    need = int(re.search(r"needs (\d+) tokens", e.value.body["message"]).group(1))
    status, _, text = raw(server, "POST", "/v1/chat/completions",
                          {"messages": ASK, "response_format": fmt, "max_tokens": 6})
    assert status == 400 and json.loads(text)["error"]["param"] == "max_tokens"
    one = client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=need)
    assert one.choices[0].finish_reason == "stop" and one.usage.completion_tokens <= need
    validate(json.loads(one.choices[0].message.content), fmt["json_schema"]["schema"])


@pytest.mark.parametrize("schema,keyword,path", [
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "$ref", "#/properties/a"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "\\p{Lu}"}}}, "pattern", "#/properties/a"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}, "maxContains": 2}, "contains", "#"),
    ({"$defs": {"x": {"$dynamicRef": "#meta"}}, "$ref": "#/$defs/x"}, "$dynamicRef", "#/$ref")])
def test_what_nothing_can_honour_is_400_naming_keyword_and_path(client, schema, keyword, path):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, response_format=schema_format(schema), max_tokens=32)
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert f"{keyword!r} at {path}" in e.value.body["message"], e.value.body["message"]


def test_tools_on_auto_with_a_format_reply_with_the_json(client):
    from jsonschema import validate

    one = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER],
                                         response_format=schema_format(PERSON), max_tokens=160)
    assert one.model_extra["clover"]["structured"][0]["method"] == "infill"
    validate(json.loads(one.choices[0].message.content), PERSON)


@pytest.mark.parametrize("fmt,param", [({"type": "xml"}, "response_format"),
                                       ({"type": "json_schema", "json_schema": {"name": "x"}},
                                        "response_format.json_schema.schema"),
                                       (schema_format({"type": "nope"}), "response_format.json_schema.schema")])
def test_bad_response_format_is_400(client, fmt, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=8)
    assert e.value.body["param"] == param


def test_an_infilled_document_longer_than_max_tokens_is_decoded_under_its_grammar(client):
    """Infilling lays out every string at its widest; when the document comes out longer than
    max_tokens, the grammar path (whose caps fit the budget) answers instead of a cut reply."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(12)},
              "required": [f"p{i}" for i in range(12)]}
    fmt = schema_format(schema)
    wide = client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=900)
    wide_info = wide.model_extra["clover"]["structured"][0]
    assert wide_info["method"] == "infill" and wide_info["valid"]
    budget = wide.usage.completion_tokens - 1  # one token short of the infilled document
    one = client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=budget)
    info = one.model_extra["clover"]["structured"][0]
    assert one.choices[0].finish_reason == "stop" and info["valid"] and info["method"] == "grammar"
    assert one.usage.completion_tokens <= budget
    assert info["forward_passes"] > wide_info["forward_passes"]  # the infill's forwards are counted too
    from jsonschema import validate
    validate(json.loads(one.choices[0].message.content), schema)
