"""Forced tool calls and `response_format` through the official `openai` client, on tiny random models
(several seeds) with a real Clover tokenizer: `tool_choice="required"` with parallel_tool_calls
returns 1..max_tool_calls calls, as many as the model decides (an options slot after each call:
another `<tool_call>` or the end of the turn), each valid for its own tool's schema; named choices
and parallel_tool_calls=false exactly one; streamed replies carry the same calls (one index each);
`chat.completions.parse` with pydantic models (Optional, nested, list, Literal, Enum, unions)
parses every reply, streamed or not."""

import enum
import json
from contextlib import contextmanager
from typing import Literal, Optional, Union

import openai
import pytest
import torch
from jsonschema import FormatChecker, validators
from pydantic import BaseModel

from clover.api import eos_ids
from clover.chat import CALL_CLOSE, CALL_OPEN
from clover.engine.infill import pieces
from clover.server import Settings, create_app
from clover.server.structured import _end_of_turn
from clover.structured import corpus, normalize
from server_utils import TOOL_ASK, WEATHER, RunningServer, tools_model

CAP = 3  # the servers' max_tool_calls
SEEDS = (0, 1, 2)
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
REFUSED = {"type": "function", "function": {"name": "fetch_remote", "parameters": {
    "type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}}}  # nothing can honour it
ASKS = [TOOL_ASK, [{"role": "user", "content": "What time is it, and the weather in Rome and Oslo?"}]]
BFCL = [r for r in corpus.bfcl_requests() if len(r) >= 2][:2]
CASES = [([WEATHER, TIME], ASKS[0]), ([WEATHER, TIME], ASKS[1])] + [(r, ASKS[0]) for r in BFCL]


@pytest.fixture(scope="module", params=SEEDS, ids=[f"seed{s}" for s in SEEDS])
def served(request, tmp_path_factory):
    """(client, model, tokenizer) of a server on a tiny random model of this seed."""
    model, tokenizer = tools_model(tmp_path_factory.mktemp(f"tools-{request.param}"), request.param)
    settings = Settings(model_id="tiny", block_size=4, threshold=0.5, max_batch=8, max_queue=16, max_tool_calls=CAP)
    with RunningServer(create_app(model, tokenizer, settings, eos_ids(model, tokenizer))) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0), model, tokenizer


@contextmanager
def leaning(model, tokenizer, towards: str | None):
    """The model's logits pushed towards "another" call (the newline before a <tool_call> block) or
    "done" (the end of the turn): the decision after each call is the model's, so this sets it."""
    if towards is None:
        yield
        return
    tok = (pieces(tokenizer, ["\n"], before=CALL_CLOSE, after=CALL_OPEN)[0][0] if towards == "another"
           else _end_of_turn(model, tokenizer))
    bias = torch.zeros(model.config.vocab_size)
    bias[tok] = 60.0
    hook = model.lm_head.register_forward_hook(lambda m, i, out: out + bias.to(out.device, out.dtype))
    try:
        yield
    finally:
        hook.remove()


def calls(message):
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def check_calls(message, tools):
    """Every call names one of `tools` and its arguments validate against that tool's schema (as sent
    and normalised, formats checked); the ids are distinct."""
    specs = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    assert message.content is None and message.tool_calls
    for name, args in calls(message):
        value = json.loads(args)
        for schema in (specs[name], normalize(specs[name])):
            errors = list(validators.validator_for(schema)(schema, format_checker=FormatChecker()).iter_errors(value))
            assert not errors, (name, args, errors[:2])
    ids = [c.id for c in message.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)


def streamed(client, kw):
    """The stream's calls reassembled by index, each call's head once, and the finish reason."""
    chunks = list(client.chat.completions.create(**kw, stream=True))
    by_index, heads = {}, []
    for ch in chunks:
        for tc in ch.choices[0].delta.tool_calls or [] if ch.choices else []:
            if tc.id:
                heads.append(tc.index)
                by_index[tc.index] = [tc.function.name, ""]
            by_index[tc.index][1] += tc.function.arguments or ""
    assert heads == sorted(heads) == list(range(len(heads)))
    return [tuple(by_index[i]) for i in heads], chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("towards", [None, "another", "done"])
def test_required_returns_the_calls_the_model_decides(served, towards):
    client, model, tokenizer = served
    counts = []
    for tools, ask in CASES:
        kw = dict(model="tiny", messages=ask, tools=tools, tool_choice="required")
        with leaning(model, tokenizer, towards):
            one = client.chat.completions.create(**kw)
            msg, finish = one.choices[0].message, one.choices[0].finish_reason
            info = one.model_extra["clover"]["structured"][0]
            assert finish == "tool_calls" and info["valid"], (finish, info)
            check_calls(msg, tools)
            counts.append(len(msg.tool_calls))
            assert counts[-1] == {None: counts[-1], "another": CAP, "done": 1}[towards]
            # the same calls streamed, one index each, and through the client's stream helper
            assert streamed(client, kw) == (calls(msg), finish)
            with client.chat.completions.stream(**kw) as s:
                done = [(e.index, e.name, e.arguments) for e in s if e.type == "tool_calls.function.arguments.done"]
            assert done == [(k, n, a) for k, (n, a) in enumerate(calls(msg))]
            # parallel_tool_calls=false: exactly one, the parallel reply's first call
            only = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
            assert calls(only.message) == calls(msg)[:1] and only.finish_reason == "tool_calls"
            # a named function: exactly one call, of that name
            name = tools[-1]["function"]["name"]
            named = client.chat.completions.create(**kw | {"tool_choice": {"type": "function",
                                                                           "function": {"name": name}}})
            assert [n for n, _ in calls(named.choices[0].message)] == [name]
            check_calls(named.choices[0].message, tools)
        # each call's own forwards, and one for each decision after a call (none after the last one allowed)
        n = len(msg.tool_calls)
        assert [c["name"] for c in info["calls"]] == [name for name, _ in calls(msg)]
        assert info["forward_passes"] == sum(c["forward_passes"] for c in info["calls"]) + (n if n < CAP else n - 1)
    assert all(1 <= n <= CAP for n in counts)


def test_the_other_tools_schemas_never_matter(served):
    client, model, tokenizer = served
    kw = dict(model="tiny", messages=TOOL_ASK, tools=[REFUSED, WEATHER, TIME], tool_choice="required")
    with leaning(model, tokenizer, "another"):
        one = client.chat.completions.create(**kw)
    assert len(one.choices[0].message.tool_calls) == CAP
    assert {n for n, _ in calls(one.choices[0].message)} <= {"get_weather", "get_time"}
    check_calls(one.choices[0].message, [WEATHER, TIME])
    with pytest.raises(openai.BadRequestError) as e:  # ... unless it is the one named
        client.chat.completions.create(**kw | {"tool_choice": {"type": "function", "function": {"name": "fetch_remote"}}})
    assert "'$ref' at #/properties/a" in e.value.body["message"]


def test_a_later_call_the_budget_cannot_hold_is_left_out(served):
    """Every returned call is complete: one cut by max_tokens after the first is dropped, "length"."""
    client, model, tokenizer = served
    kw = dict(model="tiny", messages=TOOL_ASK, tools=[WEATHER], tool_choice="required")
    with leaning(model, tokenizer, "another"):
        whole = client.chat.completions.create(**kw)
        first = client.chat.completions.create(**kw, parallel_tool_calls=False).usage.completion_tokens
        cut = client.chat.completions.create(**kw, max_tokens=first + 3)  # no room for a second call
        # streamed: the call left out was never shown (its head is sent once a try of it streams or it is kept)
        cut_stream = streamed(client, kw | {"max_tokens": first + 3})
    assert len(whole.choices[0].message.tool_calls) == CAP and whole.choices[0].finish_reason == "tool_calls"
    msg, info = cut.choices[0].message, cut.model_extra["clover"]["structured"][0]
    assert 1 <= len(msg.tool_calls) < CAP and cut.choices[0].finish_reason == "length"
    assert calls(msg) == calls(whole.choices[0].message)[: len(msg.tool_calls)] and "left out" in info["note"]
    check_calls(msg, [WEATHER])
    assert cut.usage.completion_tokens == first
    assert cut_stream == (calls(msg), "length")


# ---- chat.completions.parse with pydantic models --------------------------------------------------------
class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"


class Address(BaseModel):
    city: str
    zip: Optional[str]


class Profile(BaseModel):
    name: str
    age: Optional[int]
    tags: list[str]
    level: Literal["low", "high"]
    color: Color
    home: Address


class Key(BaseModel):
    key: Union[int, str]
    score: Union[float, None]


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Owner(BaseModel):
    pet: Union[Cat, Dog]
    others: list[Address]


@pytest.mark.parametrize("model", [Address, Profile, Key, Owner], ids=lambda m: m.__name__)
def test_parse_with_pydantic_models(served, model):
    client = served[0]
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Fill it in."}], response_format=model)
    one = client.chat.completions.parse(**kw)
    assert isinstance(one.choices[0].message.parsed, model) and one.choices[0].finish_reason == "stop"
    info = one.model_extra["clover"]["structured"][0]
    assert info["valid"] and info["method"] in ("infill", "grammar")
    with client.chat.completions.stream(**kw) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.parsed == one.choices[0].message.parsed
    assert final.choices[0].message.content == one.choices[0].message.content
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        **kw | {"response_format": {"type": "json_schema", "json_schema": {
            "name": model.__name__, "schema": model.model_json_schema()}}}, stream=True) if ch.choices)
    model.model_validate_json(text)  # the schema as pydantic writes it (not strict) parses too


def test_a_call_left_out_was_never_shown_to_a_stream(served):
    """A stream shows a call (its head, then arguments) only once a try of it streams or it is kept: a later
    call that max_tokens cannot hold (left out before or after it decoded) never was (the stream would
    end in an error: its final reply has fewer calls than were sent)."""
    from clover.chat.template import render_chat
    from clover.engine.slots import drive
    from clover.server.protocol import ToolPlan
    from clover.server.structured import Progress, infill_tool_call_task

    _, model, tokenizer = served
    ids = tokenizer(render_chat(TOOL_ASK, add_generation_prompt=True, tools=[WEATHER])).input_ids
    plan = ToolPlan([WEATHER], [WEATHER["function"]], "required", True)
    with leaning(model, tokenizer, "another"):
        first = drive(infill_tool_call_task(model, tokenizer, ids, plan, 0.5, 4, max_calls=1)).completion_tokens
        for extra in (0, 3, 12, 24):
            progress = Progress()
            reply = drive(infill_tool_call_task(model, tokenizer, ids, plan, 0.5, 4, first + extra, CAP, progress))
            shown = [(call_id, name) for call_id, name, _ in progress.parts]
            assert shown == [(c["id"], c["function"]["name"]) for c in reply.tool_calls], extra
            assert progress.read() == reply.view()


@pytest.mark.parametrize("towards", [None, "another"])
def test_required_over_every_bfcl_tool_set(served, towards):
    """Every BFCL-style request (floats with format "float", arrays without maxItems, several tools):
    at least one call, each valid for its own tool's schema; with the model leaning to more calls (on
    every sixth request), max_tool_calls of them, or fewer and "length" when the budget ran out first.
    Streamed: the same calls."""
    client, model, tokenizer = served
    for k, tools in enumerate(corpus.bfcl_requests()):
        if towards and k % 6:
            continue
        kw = dict(model="tiny", messages=TOOL_ASK, tools=tools, tool_choice="required")
        with leaning(model, tokenizer, towards):
            one = client.chat.completions.create(**kw)
            msg, finish, info = one.choices[0].message, one.choices[0].finish_reason, one.model_extra["clover"]
            check_calls(msg, tools)
            assert info["structured"][0]["valid"] and 1 <= len(msg.tool_calls) <= CAP, (k, info)
            if towards:
                assert (len(msg.tool_calls), finish) == (CAP, "tool_calls") or (
                    finish == "length" and "left out" in info["structured"][0]["note"]), (k, finish, info)
            else:
                assert finish == "tool_calls", (k, info)
            if k % 4 == 0:
                assert streamed(client, kw) == (calls(msg), finish)


def test_a_layout_longer_than_the_context_takes_the_grammar_path(served):
    """An infill layout that cannot fit the context (64 string properties, each slot at its widest) is decoded
    under the grammar within max_tokens instead (it used to be a 500), for a forced call and a
    response_format alike: valid, never cut."""
    client, model, tokenizer = served
    def wide(n):  # n string properties: n string slots in the layout (and n signatures in a tool's prompt)
        return {"type": "object", "properties": {f"a{i}": {"type": "string"} for i in range(n)}}

    tool = {"type": "function", "function": {"name": "store", "parameters": wide(48)}}
    for kw in (dict(tools=[tool], tool_choice="required"),
               dict(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": wide(100)}})):
        one = client.chat.completions.create(model="tiny", messages=TOOL_ASK, max_tokens=48, **kw)
        info, finish = one.model_extra["clover"]["structured"][0], one.choices[0].finish_reason
        assert info["method"] == "grammar" and finish in ("tool_calls", "stop") and info["valid"], (finish, info)
        if finish == "tool_calls":
            check_calls(one.choices[0].message, [tool])
