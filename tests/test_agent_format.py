"""The local toolbox and its training dialogues (loss on the assistant turns only); the wire format
itself (template, tool-call frame, think split) is tested in test_chat.py."""

import json
import random

import pytest

from clover.data import toolbox
from clover.chat import EMPTY_THINK, normalize_messages, parse_tool_calls, render_chat
from clover.data import tasks
from clover.data.dataset import encode_record
from clover.data.tokenizer import load_tokenizer, train_tokenizer



@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [render_chat(d["messages"], tools=d["tools"]) for d in toolbox.training_dialogues(0, 60)]
    return load_tokenizer(train_tokenizer(texts, 600, tmp_path_factory.mktemp("tok")))


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
