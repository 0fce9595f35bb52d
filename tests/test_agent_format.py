"""Tool-use prompt format: the chat template vs its Python twin, the tool-call parser, tool-spec
validation, the local toolbox and its training dialogues (loss on the assistant turns only)."""

import json
import random

import pytest

from clover.agent import toolbox
from clover.agent.tool_format import (EMPTY_THINK, ToolSpecError, normalize_messages, parse_tool_calls,
                                      tool_signature, validate_tools)
from clover.data import tasks
from clover.data.dataset import encode_record
from clover.data.tokenizer import load_tokenizer, render_chat, train_tokenizer

ADD = toolbox.SPECS["add"]
CONVERT = toolbox.SPECS["convert_length"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [render_chat(d["messages"], tools=d["tools"]) for d in toolbox.training_dialogues(0, 60)]
    return load_tokenizer(train_tokenizer(texts, 600, tmp_path_factory.mktemp("tok")))


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
def test_template_equals_python_twin(tok, gen, think):
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


def test_toolbox_runs_tools_for_real():
    box = toolbox.Toolbox(3)
    assert box.run("add", {"a": 2, "b": 40}) == "42" and box.run("subtract", {"a": 2, "b": 40}) == "-38"
    assert box.run("convert_length", {"value": 1, "from_unit": "mi", "to_unit": "km"}) == "1.6"
    assert box.run("get_weather", {"city": "Oslo"}) == str(box.weather["Oslo"])
    assert box.run("get_age", {"name": "Zed"}).startswith("error") and box.run("nope", {}).startswith("error")
    assert toolbox.Toolbox(3).weather == box.weather != toolbox.Toolbox(4).weather


def test_cases_are_seeded_and_consistent():
    cs = toolbox.cases(1, 70)
    assert cs == toolbox.cases(1, 70) and {c["kind"] for c in cs} == set(toolbox.KINDS)
    held = {c["request"] for c in toolbox.cases(2, 40)}
    for c in toolbox.cases(3, 140, exclude=held):
        names = [t["function"]["name"] for t in c["tools"]]
        assert len(set(names)) == len(names) >= 1
        assert all(call["name"] in names for call in c["calls"])  # the needed tool is on offer
        assert (c["kind"] == "irrelevant") == (not c["calls"])
        assert c["kind"] in toolbox.SMALL_KINDS or c["request"] not in held


def test_dialogue_round_trip_and_loss_mask(tok):
    rng = random.Random(0)
    for kind in toolbox.KINDS:
        case = toolbox.make_case(rng, kind)
        box = toolbox.Toolbox(9)
        d = toolbox.case_dialogue(case, box)
        ids, mask = encode_record(d, tok)
        assert tok.decode(ids) == render_chat(d["messages"], tools=d["tools"]) + "<|endoftext|>"
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        if not case["calls"]:
            assert trained == case["answer"] + "<|im_end|><|endoftext|>"
            continue
        # the model's tool call parses back to the case's calls; its answer uses the real results
        first = d["messages"][1]
        text = normalize_messages([first])[0]["content"]
        _, calls, problems = parse_tool_calls(text, case["tools"])
        assert not problems and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [(c["name"], c["arguments"]) for c in case["calls"]]
        results = [box.run(c["name"], c["arguments"]) for c in case["calls"]]
        answer = toolbox.final_answer(case, results)
        assert trained == text[len(EMPTY_THINK):] + "<|im_end|>" + answer + "<|im_end|><|endoftext|>"
        assert "tool_response" not in trained and "# Tools" not in trained


def test_group_rendering_is_unchanged_for_plain_tasks(tok):
    ex = tasks.task_add(random.Random(5))
    msgs = tasks.chat_messages(ex, think=False)
    assert normalize_messages(msgs) == msgs  # replies that open a think block are left as they are
