"""Structured output and tools, hardening round 2 (issue 53): satisfiable schemas answered (no 500, no
false 400), no reply ever cut (a 400 naming max_tokens before decoding instead), grammar compiles
bounded in time (a 400 past the budget), errors that name the request field and none of our
internals, structured replies in /metrics. Official `openai` client and raw HTTP."""

import json
import time

import openai
import pytest
from jsonschema import validate

from server_utils import TOOL_ASK, metric, raw, tools_server_fixtures

SCHEMA_PARAM = "response_format.json_schema.schema"
UNDECLARED = {"type": "object", "required": ["title"], "properties": {"titles": {"type": "string"}}}
MAP_REQUIRED = {"type": "object", "additionalProperties": {"type": "string"}, "required": ["a", "b", "c", "d"]}
NEVER_OPTIONAL = {"type": "object", "properties": {"b": {"type": "object", "enum": ["x"]}, "c": {"type": "boolean"}}}


loaded, server, client = tools_server_fixtures("tools-hardening-model")


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


def tool(parameters, name="act"):
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def error_of(text) -> dict:
    return json.loads(text)["error"]


@pytest.mark.parametrize("schema", [UNDECLARED, MAP_REQUIRED, NEVER_OPTIONAL], ids=["undeclared", "map", "never"])
def test_satisfiable_schemas_are_answered_valid(client, server, schema):
    """Items 1 and 2: a required key nothing declares (was a 500), a map with more required keys than
    its cap and an optional property no value satisfies (were 400s): a valid reply, as response_format
    and as a forced call's parameters, through the official client and raw HTTP."""
    one = client.chat.completions.create(model="tiny", messages=TOOL_ASK, response_format=fmt(schema), max_tokens=200)
    value = json.loads(one.choices[0].message.content)
    validate(value, schema)
    assert one.choices[0].finish_reason == "stop" and set(schema.get("required", [])) <= set(value)
    call = client.chat.completions.create(model="tiny", messages=TOOL_ASK, tools=[tool(schema)], tool_choice="required",
                                          max_tokens=200).choices[0]
    assert call.finish_reason == "tool_calls"
    validate(json.loads(call.message.tool_calls[0].function.arguments), schema)
    status, _, text = raw(server, "POST", "/v1/chat/completions",
                          {"messages": TOOL_ASK, "response_format": fmt(schema), "max_tokens": 200})
    assert status == 200, text
    validate(json.loads(json.loads(text)["choices"][0]["message"]["content"]), schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "minLength": 3},
                                               "minItems": 2}, "n": {"type": "integer"}}, "required": ["tags", "n"]},
    {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(12)}},
    {"type": "object", "properties": {"v": {"type": "string", "pattern": "^[a-z]{12}$"}}, "required": ["v"]},
], ids=["arrays", "wide", "pattern"])
def test_no_reply_is_ever_cut(client, server, schema):
    """Item 3: whatever max_tokens, a complete valid document ("stop") or, when even the smallest one
    cannot fit, a 400 naming max_tokens and the tokens it needs; never finish_reason "length"."""
    need = None
    for budget in (1, 4, 12, 24, 48, 96):
        try:
            one = client.chat.completions.create(model="tiny", messages=TOOL_ASK, response_format=fmt(schema),
                                                 max_tokens=budget)
        except openai.BadRequestError as e:
            assert e.body["param"] == "max_tokens" and "needs" in e.body["message"], e.body
            need = int(e.body["message"].rsplit("needs ", 1)[1].split()[0])
            assert need > budget
            continue
        assert one.choices[0].finish_reason == "stop" and one.usage.completion_tokens <= budget
        assert need is None or budget >= need
        validate(json.loads(one.choices[0].message.content), schema)
    status, _, text = raw(server, "POST", "/v1/chat/completions",
                          {"messages": TOOL_ASK, "tools": [tool(schema)], "tool_choice": "required", "max_tokens": 1})
    assert status == 400 and error_of(text)["param"] == "max_tokens", text


def test_a_grammar_that_compiles_too_long_is_a_400_in_bounded_time(client, server, monkeypatch):
    """Item 4: a compile past the grammar path's budget is stopped and answered 400 naming the field,
    within the budget, and the server answers the next request."""
    from clover.structured import grammar

    monkeypatch.setattr(grammar, "IN_PROCESS_CHARS", 0)
    monkeypatch.setattr(grammar, "COMPILE_SECONDS", 0.0)  # past it at once, whatever the machine
    schema = {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"anyOf": [{"type": "string", "pattern": "^q[0-9]+$"}, {"type": "integer"}]},
        "b": {"type": "array", "items": {"type": "object", "patternProperties": {"^z": {"type": "string"}}}}}}
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=TOOL_ASK, response_format=fmt(schema), max_tokens=100)
    assert time.monotonic() - start < 30
    assert e.value.body["param"] == SCHEMA_PARAM and "did not compile within" in e.value.body["message"]
    status, _, text = raw(server, "POST", "/v1/chat/completions",
                          {"messages": TOOL_ASK, "tools": [tool(schema)], "tool_choice": "required", "max_tokens": 100})
    assert status == 400 and error_of(text)["param"] == "tools" and "did not compile" in error_of(text)["message"]
    monkeypatch.undo()
    one = client.chat.completions.create(model="tiny", messages=TOOL_ASK, response_format=fmt(schema), max_tokens=100)
    validate(json.loads(one.choices[0].message.content), schema)


def test_errors_name_the_field_and_none_of_our_internals(client, server):
    """Item 5: the grammar library's refusal without its C++ source path, naming the field; a tool
    whose enum fills the context is blamed on `tools`, not `messages`."""
    contradictory = {"type": "object", "maxProperties": 1, "required": ["a", "b"],
                     "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    for body, param in (({"response_format": fmt(contradictory)}, SCHEMA_PARAM),
                        ({"tools": [tool(contradictory)], "tool_choice": "required"}, "tools")):
        status, _, text = raw(server, "POST", "/v1/chat/completions", {"messages": TOOL_ASK, "max_tokens": 64, **body})
        err = error_of(text)
        assert status == 400 and err["param"] == param and "maxProperties" in err["message"], text
        assert ".cc" not in err["message"] and "/project" not in err["message"]
    huge = tool({"type": "object", "properties": {"v": {"enum": [f"value number {i}" for i in range(3000)]}}})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=TOOL_ASK, tools=[huge], max_tokens=8)
    assert e.value.body["param"] == "tools" and "context" in e.value.body["message"]
    status, _, text = raw(server, "POST", "/v1/chat/completions",
                          {"messages": TOOL_ASK, "tools": [huge], "tool_choice": "required", "max_tokens": 8})
    assert status == 400 and error_of(text)["param"] == "tools", text


def test_structured_replies_are_counted_in_tokens_and_latency(client, server):
    """Item 6: /metrics counts a structured reply's tokens and latency, not only the request."""
    names = ("clover_generated_tokens_total", "clover_prompt_tokens_total", "clover_request_latency_seconds_count",
             "clover_structured_replies_total")
    before = {n: metric(server, n) for n in names}
    one = client.chat.completions.create(model="tiny", messages=TOOL_ASK, response_format=fmt(UNDECLARED),
                                         max_tokens=64, n=2)
    after = {n: metric(server, n) for n in names}
    assert after["clover_generated_tokens_total"] - before["clover_generated_tokens_total"] == one.usage.completion_tokens
    assert after["clover_prompt_tokens_total"] - before["clover_prompt_tokens_total"] == one.usage.prompt_tokens
    assert after["clover_request_latency_seconds_count"] - before["clover_request_latency_seconds_count"] == 2
    assert after["clover_structured_replies_total"] - before["clover_structured_replies_total"] == 1
