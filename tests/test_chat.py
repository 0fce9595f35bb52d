"""clover.chat, the wire format: the chat template vs its Python twin, the `<tool_call>` frame (written,
parsed, streamed), tool-spec validation, the `<think>` split and call ids."""

import json

import pytest

from clover.data import toolbox
from clover.chat import (CALL_END, CALL_HEAD, CALL_OPEN, EMPTY_THINK, ToolSpecError, after_thinking,
                         format_tool_call, new_call_id, normalize_messages, parse_tool_calls, render_chat,
                         split_partial, split_thinking, text_before_call, tool_signature, validate_tools)
from helpers import tiny_tokenizer

ADD = toolbox.SPECS["add"]
CONVERT = toolbox.SPECS["convert_length"]


def dialogues():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    yield [{"role": "user", "content": "hi"}], None
    yield [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}], [ADD, CONVERT]
    yield [{"role": "user", "content": "What is 2+3?"},
           {"role": "assistant", "content": None, "tool_calls": [call, {"function": {"name": "add", "arguments": {"a": 1, "b": 1}}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "tool", "content": "2"},
           {"role": "assistant", "content": "It is 5."}, {"role": "user", "content": "thanks"}], [ADD]
    yield [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure.", "tool_calls": [call]},
           {"role": "tool", "content": "5"}], [ADD]
    for d in toolbox.training_dialogues(5, 14):
        yield d["messages"], d["tools"]


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("think", [False, True])
def test_template_equals_python_twin(gen, think):
    tok = tiny_tokenizer()
    for msgs, tools in dialogues():
        got = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen, enable_thinking=think)
        assert got == render_chat(msgs, gen, think, tools=tools)


def test_rendering_details():
    msgs, tools = list(dialogues())[2]
    turns = normalize_messages(msgs, tools)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert turns[0]["content"].endswith("<tools>\nadd(a: integer, b: integer) - Add two integers.\n</tools>")
    assert turns[2]["content"] == (EMPTY_THINK + '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
                                   '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>')
    assert turns[3]["content"] == "<tool_response>\n5\n</tool_response>\n<tool_response>\n2\n</tool_response>"
    assert turns[4]["content"] == EMPTY_THINK + "It is 5."
    sys_turn = normalize_messages(*list(dialogues())[1])[0]["content"]
    assert sys_turn.startswith("Be brief.\n\n# Tools")
    assert tool_signature(CONVERT) == ('convert_length(value: number, from_unit: "km"|"mi"|"m"|"ft", '
                                       'to_unit: "km"|"mi"|"m"|"ft") - Convert a length.')
    opt = {"name": "f", "parameters": {"type": "object", "properties": {"x": {}}}}
    assert tool_signature(opt) == "f(x?: any)"


def test_parse_tool_calls():
    text = 'ok <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    content, calls, problems = parse_tool_calls(text, [ADD])
    assert content == "ok" and not problems
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert all(c["type"] == "function" and c["function"]["name"] == "add" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    for bad, why in [('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "malformed"),
                     ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "unknown function"),
                     ('<tool_call>{"arguments": {}}</tool_call>', "malformed"),
                     ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "arguments an object"),
                     ('<tool_call>{"name": "add", "arg', "unterminated")]:
        content, calls, problems = parse_tool_calls(bad, [ADD])
        assert calls == [] and content == bad and any(why in p for p in problems), (bad, problems)
    assert parse_tool_calls("plain answer") == ("plain answer", [], [])


def test_validate_tools_names_the_fault():
    assert validate_tools([ADD, CONVERT]) == [ADD["function"], CONVERT["function"]]
    for tools, why in [("x", "must be a list"), ([{"type": "code"}], "only"), ([{"function": {"name": "1x"}}], "identifier"),
                       ([ADD, ADD], "duplicate"), ([{"function": {"name": "f", "parameters": {"type": "array"}}}], "object")]:
        with pytest.raises(ToolSpecError, match=why):
            validate_tools(tools)


def test_frame_round_trip():
    calls = [{"name": "add", "arguments": {"a": 1, "b": -2}}, {"function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}},
             {"name": "convert_length", "arguments": {"value": 1.5, "from_unit": "km", "to_unit": "mi"}}]
    text = "Sure.\n" + "\n".join(format_tool_call(c) for c in calls)
    content, got, problems = parse_tool_calls(text, [ADD, CONVERT])
    assert content == "Sure." and not problems
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == \
        [("add", {"a": 1, "b": -2}), ("add", {"a": 3, "b": 4}),
         ("convert_length", {"value": 1.5, "from_unit": "km", "to_unit": "mi"})]
    one = format_tool_call(calls[0])
    assert one.startswith(CALL_HEAD) and one.endswith(CALL_END)  # what the infilled forced calls lay out
    assert parse_tool_calls(CALL_HEAD + '"add", "arguments": {"a": 1, "b": 2}' + CALL_END)[1][0]["function"]["name"] == "add"


def test_call_ids_are_unique_and_openai_shaped():
    ids = [new_call_id() for _ in range(500)]
    assert len(set(ids)) == 500 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    int(ids[0][5:], 16)  # hex digits


@pytest.mark.parametrize("text,before", [
    ("plain answer", "plain answer"), ("ok <tool_call>{...", "ok "), ("ok <tool_", "ok "), ("ok <", "ok "),
    ("a < b", "a < b"), ("x <tool_call> y <tool_call>", "x "), ("", ""), ("<tool_call", ""),
])
def test_text_before_call_holds_back_a_possible_frame(text, before):
    assert text_before_call(text) == before


def test_text_before_call_grows_into_the_final_content():
    text = "Let me look. " + format_tool_call({"name": "add", "arguments": {"a": 1}})
    shown = [text_before_call(text[:n]) for n in range(len(text) + 1)]
    assert all(a == b[:len(a)] for a, b in zip(shown, shown[1:]))  # never takes back what it showed
    assert shown[-1].strip() == parse_tool_calls(text)[0] and CALL_OPEN not in "".join(shown)


def test_split_thinking():
    assert split_thinking("<think>\ncarry 1\n</think>\n\n4") == ("carry 1", "4")
    assert split_thinking("just text") == (None, "just text")
    assert split_thinking(EMPTY_THINK + "5") == ("", "5")
    assert split_thinking("<think>open only") == (None, "<think>open only")  # not closed: all text
    assert split_thinking("no open</think> a </think> b") == ("no open", "a </think> b")  # the first close ends it
    assert after_thinking("<think>r</think> a </think> b ") == "b" and after_thinking(" x ") == "x"


def test_split_partial_grows_with_the_reply():
    assert split_partial("<think>\nwe") == ("we", "", False)
    assert split_partial("<think>\nwe need 4 \n") == ("we need 4 \n", "", False)  # may be the block's end
    assert split_partial("<think>\nwe need 4 \n</think>\n\nIt is") == ("we need 4", "It is", True)
    assert split_partial("") == ("", "", False)
    reply = "<think>\nwe need 4.\n</think>\n\nIt is 4."
    reasoning, answer, closed = split_partial(reply)
    assert closed and (reasoning, answer) == split_thinking(reply)
