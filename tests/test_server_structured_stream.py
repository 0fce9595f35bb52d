"""Structured replies (response_format json_schema / json_object, forced tool calls) as an OpenAI /
vLLM client sees them, through the official `openai` client on a tiny random model: streamed as
they decode (several content deltas, the first before the reply is done; tool calls as id + name,
then arguments fragments), the deltas concatenating to the whole reply exactly; a sampled response_format
reply samples (tests/test_structured_sampling.py); stop strings in forced calls refused naming the
field; stop strings cut a response_format reply."""

import json
import time

import openai
import pytest

from clover.api import eos_ids
from clover.server import Settings, create_app
from clover.server.structured import Progress, Sent
from server_utils import TOOL_ASK, WEATHER, RunningServer, tools_model

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                              "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}}}
ANY = {"type": "json_object"}
NEEDS_GRAMMAR = {"type": "json_schema", "json_schema": {"name": "pick", "schema": {
    "type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]}},
    "required": ["v"]}}}
SLOW_S = 0.03  # each forward of the served model is slowed this much, so a stream has time to show deltas


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, tokenizer = tools_model(tmp_path_factory.mktemp("stream"), 0)
    hook = model.lm_head.register_forward_hook(lambda m, i, out: time.sleep(SLOW_S))
    settings = Settings(model_id="tiny", block_size=4, threshold=0.5, max_batch=8, max_queue=16, max_tool_calls=3)
    try:
        with RunningServer(create_app(model, tokenizer, settings, eos_ids(model, tokenizer))) as s:
            yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    finally:
        hook.remove()


def _stream(client, **kw):
    """(chunks, arrival time of each, the time the request was sent)."""
    sent = time.monotonic()
    chunks, times = [], []
    for ch in client.chat.completions.create(model="tiny", stream=True, **kw):
        chunks.append(ch)
        times.append(time.monotonic())
    return chunks, times, sent


@pytest.mark.parametrize("fmt", [PERSON, ANY, NEEDS_GRAMMAR], ids=["infill", "json_object", "grammar"])
def test_a_structured_reply_streams_as_it_decodes_and_equals_the_whole(served, fmt):
    kw = dict(messages=ASK, response_format=fmt, max_tokens=120)
    whole = served.chat.completions.create(model="tiny", **kw)
    text = whole.choices[0].message.content
    json.loads(text)
    chunks, times, _ = _stream(served, stream_options={"include_usage": True}, **kw)
    body = [c for c in chunks if c.choices]
    assert body[0].choices[0].delta.role == "assistant" and body[0].choices[0].delta.content == ""
    pieces = [c.choices[0].delta.content for c in body[1:] if c.choices[0].delta.content]
    assert "".join(pieces) == text
    assert len(pieces) >= 2, pieces  # deltas as it decodes, not one chunk at the end
    first = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content)
    assert times[first] < times[-1]
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in body)


def test_forced_tool_calls_stream_as_openai_does(served):
    kw = dict(messages=TOOL_ASK, tools=[WEATHER], tool_choice="required", max_tokens=120)
    whole = served.chat.completions.create(model="tiny", **kw).choices[0]
    chunks, _, _ = _stream(served, **kw)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:  # a call's head: id, type, name once, before its arguments
            assert d.index not in calls and d.type == "function" and d.function.name
            calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
        else:
            assert d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len([d for d in deltas if d.id is None]) >= 2  # arguments in fragments
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"


def test_stop_in_forced_calls_is_refused_naming_the_field(served):
    """Stop strings would cut a call's arguments to invalid JSON: a 400 naming stop. (Sampled structured
    replies: tests/test_structured_sampling.py.)"""
    with pytest.raises(openai.BadRequestError) as e:
        served.chat.completions.create(model="tiny", messages=TOOL_ASK, tools=[WEATHER], tool_choice="required",
                                       stop=["}"])
    assert e.value.body["param"] == "stop"
    copies = served.chat.completions.create(model="tiny", messages=ASK, response_format=PERSON, n=2, max_tokens=120)
    assert copies.choices[0].message.content == copies.choices[1].message.content  # temperature 0: copies


def test_stop_strings_cut_a_response_format_reply_as_vllm_does(served):
    kw = dict(messages=ASK, response_format=PERSON, max_tokens=120)
    text = served.chat.completions.create(model="tiny", **kw).choices[0].message.content
    stop = '"age"'
    got = served.chat.completions.create(model="tiny", stop=[stop], **kw).choices[0]
    assert (got.message.content, got.finish_reason) == (text[: text.index(stop)], "stop")
    chunks, _, _ = _stream(served, stop=[stop], **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == got.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sent_deltas_extend_or_break_never_rewrite():
    """Sent, without a server: deltas from growing views, a stop string held back then cut, a call's
    head once, and a view that rewrites sent text marks the stream broken (nothing more sent)."""
    sent = Sent(["END"])
    assert sent.deltas([(None, None, '{"a": 1')]) == [{"content": '{"a":'}]  # "END"'s length - 1 held back
    assert sent.deltas([(None, None, '{"a": 1E')]) == [{"content": " "}]
    assert sent.deltas([(None, None, '{"a": 1END}')], final=True) == [{"content": "1"}]
    assert sent.content == '{"a": 1' and not sent.broken
    calls = Sent([])
    assert calls.deltas([("id1", "f", '{"x"')]) == [
        {"tool_calls": [{"index": 0, "id": "id1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]}]
    assert calls.deltas([("id1", "f", "")]) == [] and calls.broken
    progress = Progress()
    watch = progress.open()
    assert progress.read() == [(None, None, "")]
    watch(lambda: "ab\ufffd")
    assert progress.read() == [(None, None, "ab")]


def test_a_format_keeps_the_grammar_path_from_streaming_mid_try():
    """A string `format` is checked after a try (the grammar lets any string through), so such a try
    may be rejected and redone: it is not streamed while it decodes."""
    from clover.structured.grammar import _uncut

    plain = {"type": "object", "properties": {"to": {"type": "string", "maxLength": 8}}, "required": ["to"],
             "additionalProperties": False}
    email = {**plain, "properties": {"to": {"type": "string", "maxLength": 8, "format": "email"}}}
    named = {**plain, "properties": {"format": {"type": "string", "maxLength": 8}}, "required": ["format"]}
    assert _uncut(plain, 0, "", "", 4096) and _uncut(named, 0, "", "", 4096)
    assert not _uncut(email, 0, "", "", 4096)


def test_only_schemas_the_check_cannot_reject_stream_a_try_before_it_is_accepted():
    from clover.structured.grammar import exact

    plain = {"type": "object", "properties": {"to": {"type": "string", "maxLength": 8}, "format": {"enum": ["a"]}},
             "required": ["to"], "additionalProperties": False}
    assert exact(plain) and exact({"type": "json_object"}) and exact({"anyOf": [{"type": "integer"}, plain]})
    for inner in ({"format": "email"}, {"pattern": "^a"}, {"multipleOf": 7}, {"oneOf": [{"type": "string"}]}):
        assert not exact({**plain, "properties": {"to": {"type": "string", **inner}}})
    assert not exact({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})  # repaired
    assert not exact({"type": "array", "prefixItems": [{"type": "string", "pattern": "b"}]})


FIVES = {"type": "json_schema", "json_schema": {"name": "fives", "schema": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 10**6, "multipleOf": 5}},
    "required": ["n"], "additionalProperties": False}}}


def test_a_retried_structured_try_is_not_streamed_before_it_is_accepted(served):
    """multipleOf over a wide range: the grammar lets any integer through, and the final check rejects the
    model's tries (not a multiple of 5: redone, sampled; the smallest document stands in at the end). The
    stream holds each try back, never ends in an error, and sends what the whole reply holds."""
    kw = dict(messages=ASK, response_format=FIVES, max_tokens=40)
    whole = served.chat.completions.create(model="tiny", **kw)
    text = whole.choices[0].message.content
    assert json.loads(text)["n"] % 5 == 0 and whole.choices[0].finish_reason == "stop"
    chunks, _, _ = _stream(served, **kw)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == text and chunks[-1].choices[0].finish_reason == "stop"
