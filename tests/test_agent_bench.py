"""The agent benchmark (`clover.benchmarks.agent`, `clover bench agent`): the AST matcher on hand-built
calls, the episode runner under a scripted stand-in for the model (real tool results fed back and
scored), a whole run on a tiny random model, and the CLI."""

from __future__ import annotations

import json
import random
import re

import pytest

import clover
from clover.benchmarks import agent as bench
from clover.chat import prompt_renderer, renders_tools
from clover.data import toolbox
from clover.data.toolbox import SPECS
from clover.cli import main
from helpers import assert_help_and_unknown_flag, save_tiny_model, tiny_tokenizer

TOOLS = [SPECS["add"], SPECS["get_weather"], SPECS["convert_length"]]
PLAIN_TEMPLATE = (  # a chat template that predates tools (the benchmark renders them through clover.chat)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if not enable_thinking | default(false) %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def call(fn, /, **arguments):
    return {"name": fn, "arguments": arguments}


def block(fn, /, **arguments):
    return "<tool_call>\n" + json.dumps({"name": fn, "arguments": arguments}) + "\n</tool_call>"


# ---- AST matching -----------------------------------------------------------------------------------
@pytest.mark.parametrize("got, reason", [
    ([call("add", a=12, b=30)], None),
    ([call("add", b=30, a=12)], None),                       # key order is irrelevant
    ([call("subtract", a=12, b=30)], "wrong function"),
    ([call("add", a=12, b=31)], "wrong value"),
    ([call("add", a=12)], "missing argument"),
    ([call("add", a=12, b=30, c=1)], "unexpected argument"),
    ([call("add", a=12.0, b=30)], "type mismatch"),          # integer parameter: a JSON integer, as BFCL
    ([call("add", a="12", b=30)], "type mismatch"),
    ([call("add", a=True, b=30)], "type mismatch"),          # a bool is not an integer
    ([], "wrong number of calls"),
    ([call("add", a=12, b=30)] * 2, "wrong number of calls"),
])
def test_match_single_call(got, reason):
    assert bench.match_calls(got, [call("add", a=12, b=30)], TOOLS) == reason


def test_match_numbers_strings_enums_and_parallel_calls():
    want = [call("convert_length", value=12, from_unit="km", to_unit="mi")]
    assert bench.match_calls([call("convert_length", value=12.0, from_unit="km", to_unit="mi")], want, TOOLS) is None
    assert bench.match_calls([call("convert_length", value="12", from_unit="km", to_unit="mi")], want, TOOLS) == "type mismatch"
    assert bench.match_calls([call("convert_length", value=12, from_unit="KM", to_unit="mi")], want, TOOLS) == "wrong value"
    paris_oslo = [call("get_weather", city="Paris"), call("get_weather", city="Oslo")]
    assert bench.match_calls(paris_oslo[::-1], paris_oslo, TOOLS) is None  # parallel: order-insensitive
    assert bench.match_calls([paris_oslo[0]] * 2, paris_oslo, TOOLS) == "wrong value"  # each call matched once
    assert bench.match_calls([call("get_weather", city="paris"), paris_oslo[1]], paris_oslo, TOOLS) == "wrong value"


def test_first_turn_scoring():
    case = {"kind": "add", "tools": TOOLS, "calls": [call("add", a=1, b=2)], "request": "", "answer": None}
    assert bench.score_first_turn(case, block("add", a=1, b=2)) == (True, None)
    assert bench.score_first_turn(case, "3") == (False, "no call")
    assert bench.score_first_turn(case, '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>') == (False, "malformed call")
    assert bench.score_first_turn(case, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}') == (False, "malformed call")
    irrelevant = {**case, "kind": "irrelevant", "calls": [], "answer": "x y"}
    assert bench.score_first_turn(irrelevant, "x y") == (True, None)
    assert bench.score_first_turn(irrelevant, block("add", a=1, b=2)) == (False, "called a tool")
    assert bench.score_first_turn(irrelevant, "<tool_call> oops") == (False, "called a tool")  # any attempt counts


def test_answer_values():
    case = {"calls": [call("get_weather", city="Oslo"), call("get_weather", city="Lima")]}
    values = bench.answer_values(case, "-3 C in Oslo and 12 C in Lima.")
    assert bench.contains_values("Lima: 12 C, Oslo: -3 C.", values)
    assert not bench.contains_values("Lima: 12 C, Oslo: 3 C.", values)
    assert not bench.contains_values("-3 C and 12 C.", values)
    sub = {"calls": [call("subtract", a=9, b=3)]}
    assert bench.answer_values(sub, "9-3 = 6.") == ["9", "3", "6"]
    assert bench.contains_values("2212320 ft", bench.answer_values({"calls": [call("convert_length")]}, "is 2.21232e+06 ft."))
    assert bench.contains_values("it is 5 5 10", bench.answer_values({"calls": [call("add")]}, "5+5 = 10."))
    assert not bench.contains_values("5 10", bench.answer_values({"calls": [call("add")]}, "5+5 = 10."))


def test_held_out_cases_exclude_training_requests():
    cases = bench.held_out_cases(70)
    assert cases == bench.held_out_cases(70)
    assert [c["kind"] for c in cases[:7]] == list(toolbox.KINDS)
    train = {c["request"] for c in toolbox.cases(4, 8000)} | {c["request"] for c in toolbox.cases(3, 400)}
    assert not [c for c in cases if c["request"] in train and c["kind"] not in toolbox.SMALL_KINDS]


# ---- episodes with a scripted model -----------------------------------------------------------------
_RESPONSES = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


def scripted(policy):
    """A stand-in for the model: policy(prompt) -> assistant text (for testing the runner only)."""
    prompts = []

    def generate(batch):
        prompts.extend(batch)
        return [bench.Turn(policy(p), forward_passes=3) for p in batch]
    return generate, prompts


def _case_of(prompt, cases):
    return next(c for c in cases if c["request"] in prompt)


def test_episodes_feed_real_results_back_and_score_them():
    cases = bench.held_out_cases(14)
    render = prompt_renderer(tiny_tokenizer())

    def perfect(prompt):  # the expected calls, then the answer the fed-back results call for
        case = _case_of(prompt, cases)
        results = _RESPONSES.findall(prompt)
        if not case["calls"]:
            return case["answer"]
        if not results:
            return "\n".join(block(c["name"], **c["arguments"]) for c in case["calls"])
        return toolbox.final_answer(case, results)

    generate, prompts = scripted(perfect)
    records = bench.run_episodes(cases, generate, render, seed=5, batch=3)
    worlds = random.Random(5 + 7)
    for rec, case in zip(records, cases):
        box = toolbox.Toolbox(worlds.randrange(1 << 30))  # the case's world, rebuilt
        real = [box.run(c["name"], c["arguments"]) for c in case["calls"]]
        assert [m["content"] for m in rec["messages"] if m["role"] == "tool"] == real
        assert rec["final"] == rec["expected_answer"] == (toolbox.final_answer(case, real) if real else case["answer"])
        assert rec["first_turn_right"] and rec["episode_exact"] and rec["episode_values"]
        assert rec["generations"] == (2 if real else 1) and rec["forward_passes"] == 3 * rec["generations"]
        assert rec["call_attempts"] == rec["valid_calls"] == len(real)
    assert any("<tool_response>" in p and "# Tools" in p for p in prompts)
    s = bench.summarize(records)
    assert s["overall"]["call_accuracy"] == s["overall"]["irrelevance_accuracy"] == s["overall"]["episode_exact"] == 100.0
    assert s["overall"]["call_validity"] == 100.0 and s["overall"]["errors"] == {}
    assert list(s["per_kind"]) == list(toolbox.KINDS) and set(s["overall"]) == set(bench.METRICS)


def test_episode_errors_rounds_and_wrong_answers():
    case = {"kind": "weather", "tools": [SPECS["get_weather"], SPECS["add"]], "request": "How warm is it in Oslo?",
            "calls": [call("get_weather", city="Oslo")], "answer": None}
    turns = iter([
        block("get_weather", city="Atlantis") + "\n" + block("get_age", name="Max") + "\n<tool_call>\n{bad\n</tool_call>",
        block("add", a=1e400, b=1),  # int(inf): the runner still answers with an error text
        block("get_weather", city="Oslo"),
        block("get_weather", city="Oslo"),  # a 4th round is not run: no final answer
    ])
    generate, prompts = scripted(lambda p: next(turns))
    rec = bench.run_episodes([case], generate, prompt_renderer(tiny_tokenizer()), seed=0)[0]
    tool = [m["content"] for m in rec["messages"] if m["role"] == "tool"]
    assert tool[0].startswith("error: bad arguments") and tool[1] == "error: unknown tool get_age"
    assert tool[2].startswith("error: malformed tool call") and tool[3].startswith("error: bad arguments")
    assert tool[4] == rec["expected_answer"].split(" C")[0]  # the real temperature in the case's world
    assert rec["rounds"] == 3 and rec["generations"] == 4 and rec["final"] is None
    assert not rec["episode_exact"] and not rec["episode_values"]
    assert rec["error"] == "malformed call" and not rec["first_turn_right"]
    assert rec["call_attempts"] == 6 and rec["valid_calls"] == 4  # get_age is not offered; {bad is not JSON
    assert "error: unknown tool get_age" in prompts[1]

    generate, _ = scripted(lambda p: "It is 20 C." if "<tool_response>" in p else block("get_weather", city="Oslo"))
    rec = bench.run_episodes([case], generate, prompt_renderer(tiny_tokenizer()), seed=0)[0]
    assert rec["first_turn_right"] and rec["final"] == "It is 20 C." and not rec["episode_exact"]


def test_native_template_renders_the_same_prompt():
    from clover.chat import CHAT_TEMPLATE

    plain, native = tiny_tokenizer(), tiny_tokenizer()
    plain.chat_template, native.chat_template = PLAIN_TEMPLATE, CHAT_TEMPLATE
    assert renders_tools(native) and not renders_tools(plain)
    case = bench.held_out_cases(4)[3]  # weather2: parallel calls
    generate, prompts = scripted(lambda p: "done" if "<tool_response>" in p else
                                 "\n".join(block(c["name"], **c["arguments"]) for c in case["calls"]))
    rec = bench.run_episodes([case], generate, prompt_renderer(plain))[0]
    render = prompt_renderer(native)
    assert render(rec["messages"], case["tools"]) == prompt_renderer(plain)(rec["messages"], case["tools"])
    assert render(rec["messages"][:1], case["tools"]) == prompts[0]


# ---- the whole benchmark on a tiny random model, and the CLI ---------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("agent_tiny"))


def test_benchmark_runs_on_a_tiny_model(tiny_dir):
    model, tokenizer = clover.load(tiny_dir)
    out = bench.run_benchmark(model, tokenizer, n=7, block_size=4, max_new_tokens=8, batch=4)
    assert len(out["records"]) == 7 and out["mode"] == "low_confidence" and out["template_renders_tools"] == renders_tools(tokenizer)
    assert set(out["overall"]) == set(bench.METRICS) and list(out["per_kind"]) == list(toolbox.KINDS)
    assert out["overall"]["forward_passes_per_case"] > 0 and out["overall"]["seconds_per_case"] > 0
    ar = bench.run_benchmark(model, tokenizer, n=2, mode="ar", max_new_tokens=4)
    assert ar["block_size"] == 1 and ar["threshold"] is None and ar["overall"]["cases"] == 2


def test_cli_bench_agent(tiny_dir, capsys):
    assert_help_and_unknown_flag(capsys, ["bench", "agent"], "--block-size")
    assert main(["bench", "agent", "--mode", "fast"]) == 2
    assert "unknown mode" in capsys.readouterr().err
    assert main(["bench", "agent", "--model", tiny_dir, "--n", "3", "--max-new-tokens", "4", "--block-size", "4",
                 "--mode", "low_confidence,ar", "--threads", "1", "--json"]) == 0
    captured = capsys.readouterr()
    obj = json.loads(captured.out)  # bare --json: stdout is one JSON object, the table on stderr
    assert [r["mode"] for r in obj["runs"]] == ["low_confidence", "ar"] and obj["n"] == 3
    assert "| decoding | kind |" in captured.err and "**overall**" in captured.err
