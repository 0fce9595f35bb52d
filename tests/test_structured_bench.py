"""The structured-output benchmark (`clover.benchmarks.structured`, `clover bench structured`): seeded cases
whose ground truth fits their schemas, the value scorer on hand-built values, the free-generation
switch of `generate_json`, and the whole benchmark and its CLI on a tiny random model."""

import json

import pytest
from jsonschema import validate

import clover
from clover.cli import main
from clover.benchmarks import structured as bench
from clover.structured import generate_json, skeleton
from clover.structured import generate as structured_generate
from helpers import assert_help_and_unknown_flag, save_tiny_model

SCHEMA = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog"]}}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, model, tokenizer) of a tiny random model."""
    folder = save_tiny_model(tmp_path_factory.mktemp("structured_bench_tiny"))
    return (folder, *clover.load(folder))


def test_cases_are_seeded_and_their_truth_fits_their_schema():
    cases = bench.cases(3)
    assert cases == bench.cases(3) and cases != bench.cases(3, seed=1)
    assert [c["kind"] for c in cases] == [k for k in bench.KINDS for _ in range(3)]
    for c in cases:
        validate(c["expected"], c["schema"])
        skeleton(c["schema"])  # every schema is in the infilled subset
        assert (c["tools"] is None) == (c["prefix"] == "")
    arith = next(c for c in cases if c["kind"] == "arithmetic")
    a, op, b = arith["messages"][0]["content"].split("What is ")[1].split("?")[0].partition(
        "+" if "+" in arith["messages"][0]["content"] else "-")
    assert arith["expected"] == {"answer": int(a) + int(b) if op == "+" else int(a) - int(b)}
    tool = next(c for c in cases if c["kind"] == "tool_convert")
    assert tool["prefix"] == '<tool_call>\n{"name": "convert_length", "arguments": ' and tool["suffix"] == "}\n</tool_call>"
    with pytest.raises(ValueError, match="unknown case kind"):
        bench.make_case(__import__("random").Random(0), "poem")


def test_value_scorer():
    want = {"name": "Ann", "age": 34, "older": True, "sorted": [1, 2]}
    assert bench.fields_right(dict(want), want) == (4, 4)
    assert bench.fields_right({"name": "Ann", "age": 34.0, "older": 1, "sorted": [2, 1]}, want) == (2, 4)
    assert bench.fields_right({"name": "ann"}, want) == (0, 4)  # case-sensitive; missing fields are wrong
    assert bench.fields_right([1], want) == (0, 4) and bench.fields_right(None, want) == (0, 4)
    assert bench.fields_right(3.0, 3) == (1, 1) and bench.fields_right(True, 1) == (0, 1)
    assert bench.same({"a": [1, {"b": False}]}, {"a": [1.0, {"b": False}]})
    assert not bench.same({"a": 1, "b": 2}, {"a": 1}) and not bench.same("1", 1) and not bench.same(0, False)
    assert not bench.same([1, 2], [1, 2, 3]) and bench.same(None, None) and not bench.same(None, 0)


def test_free_method_never_infills(tiny, monkeypatch):
    _, model, tok = tiny

    def refuse(*a, **k):
        raise AssertionError("method='free' infilled")

    monkeypatch.setattr(structured_generate, "infill_json", refuse)
    out = generate_json(model, tok, "Ann is 34. As JSON:", SCHEMA, method="free", max_new_tokens=6)
    assert out.method == "free" and "free" in out.fallback_reason and 1 <= out.forward_passes <= 6
    assert out.valid == (out.error is None)
    with pytest.raises(ValueError, match="not a valid JSON schema"):  # the schema is still checked
        generate_json(model, tok, "x", {"type": "integr"}, method="free")
    with pytest.raises(ValueError, match="method must be"):
        generate_json(model, tok, "x", SCHEMA, method="infill")
    monkeypatch.undo()
    assert generate_json(model, tok, "Ann is 34. As JSON:", SCHEMA).method == "infill"  # "auto" by default


def test_benchmark_runs_on_a_tiny_model(tiny):
    _, model, tok = tiny
    done = []
    out = bench.run_benchmark(model, tok, n=1, block_size=8, max_new_tokens=64, progress=done.append)
    assert sum(done) == len(bench.KINDS) == out["cases"] and len(out["records"]) == len(bench.METHODS) * len(bench.KINDS)
    assert {"n", "seed", "threshold", "block_size", "max_new_tokens", "kinds", "results"} <= set(out)
    for m in bench.METHODS:
        r = out["results"][m]
        assert list(r["per_kind"]) == list(bench.KINDS) and set(r["overall"]) == set(bench.METRICS)
        assert r["overall"]["cases"] == len(bench.KINDS) and r["overall"]["seconds_per_case"] > 0
        assert 1 <= r["overall"]["forward_passes_per_case"]
    assert out["results"]["infill"]["overall"]["valid_rate"] == 1.0
    assert all(r["ran"] == r["method"] for r in out["records"])
    assert all(r["forward_passes"] <= 64 for r in out["records"] if r["method"] == "free")
    for r in out["records"]:
        assert r["exact"] == (r["valid"] and r["fields_right"] == r["fields"])


def test_cli_bench_structured(tiny, tmp_path, capsys):
    tiny_dir = tiny[0]
    assert_help_and_unknown_flag(capsys, ["bench", "structured"], "--max-new-tokens")
    assert main(["bench", "structured", "--n", "0"]) == 2
    assert "--n" in capsys.readouterr().err
    assert main(["bench", "structured", "--model", tiny_dir, "--block-size", "99"]) == 2
    assert "--block-size" in capsys.readouterr().err
    records = tmp_path / "records.jsonl"
    assert main(["bench", "structured", "--model", tiny_dir, "--n", "1", "--block-size", "8", "--max-new-tokens", "4",
                 "--threads", "1", "--records", str(records), "--json"]) == 0
    captured = capsys.readouterr()
    obj = json.loads(captured.out)  # bare --json: stdout is one JSON object, the table on stderr
    assert obj["n"] == 1 and obj["threads"] == 1 and set(obj["results"]) == set(bench.METHODS)
    assert "records" not in obj and len(records.read_text().splitlines()) == len(bench.METHODS) * len(bench.KINDS)
    assert "| method | kind |" in captured.err and "**overall**" in captured.err
