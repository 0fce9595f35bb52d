"""Accuracy under parallelism: d3LLM's AUP, the Pareto settings, and calibrated commits
(`clover bench calibration`); a tiny random model, no downloads."""

import json
import math

import pytest
import torch

import clover
from clover.cli import main
from clover.eval import pareto
from clover.eval.calibration import ar_choices, calibration, committed_in_parallel



def test_aup_by_hand():
    # flat at the best accuracy: the area, rho_1 y_1 + the trapezoid
    assert pareto.aup([(2.0, 60.0), (1.0, 60.0)]) == pytest.approx(60 + 0.5 * 1 * (60 + 60))
    # a point 2 below the best is weighted by exp(-3 (1 - 58/60)); one 6 below the slowest counts nothing
    w = math.exp(-3 * (1 - 58 / 60))
    got = pareto.aup([(1.0, 60.0), (2.0, 60.0), (3.0, 58.0), (5.0, 54.0)])
    assert got == pytest.approx(120 + 0.5 * 1 * (60 + 58 * w))
    assert pareto.aup([(1.0, 50.0)], y_max=60.0) == 50.0  # the slowest point is never weighted
    with pytest.raises(ValueError):
        pareto.aup([])


def test_aup_report_and_settings():
    rows = [{"mode": "ar", "block_size": 1, "accuracy": 0.6, "tpf": 1.0},
            {"mode": "self_spec", "block_size": 8, "accuracy": 0.6, "tpf": 2.0},
            {"mode": "low_confidence", "block_size": 8, "accuracy": 0.58, "tpf": 3.0},
            {"mode": "low_confidence", "block_size": 8, "accuracy": 0.5, "tpf": 2.5}]  # dominated
    assert pareto.pareto_front(rows) == {1, 2}
    rep = pareto.aup_report(rows)
    assert rep["front"] == pytest.approx(pareto.aup([(2.0, 60.0), (3.0, 58.0)]))
    assert rep["per_curve"]["self_spec 8"] == pytest.approx(60 + 0.5 * (60 + 60))
    shared = pareto.aup_report(rows, y_max=70.0)  # another model's best: 60 is discounted
    assert shared["per_curve"]["self_spec 8"] == pytest.approx(60 + 0.5 * 2 * 60 * math.exp(-3 * (1 - 60 / 70)))
    assert pareto.settings(("ar", "self_spec", "low_confidence"), [4, 8], [0.9]) == [
        ("low_confidence", 4, 0.9), ("low_confidence", 8, 0.9), ("self_spec", 4, 0.0), ("self_spec", 8, 0.0), ("ar", 1, 0.0)]


def test_committed_in_parallel():
    assert committed_in_parallel([(0, 0), (0, 0), (0, 1), (1, 0), (1, 1), (1, 1)]) == [True, True, False, False, True, True]
    assert committed_in_parallel([]) == []


def test_ar_choices_are_the_ar_decode(model_dir):
    """The causal forward's greedy choices over an ar decode's own tokens give back those tokens."""
    from clover.engine import DecodeConfig, Engine

    model, tok = clover.load(model_dir)
    prompt = tok("Sort: 3 1 2\n").input_ids
    seq = Engine(model, DecodeConfig(mode="ar", max_new_tokens=12)).generate([prompt])[0]
    assert len(seq.token_ids) == 12 and ar_choices(model, prompt, seq.token_ids) == seq.token_ids
    wrong = seq.token_ids[:5] + [(seq.token_ids[5] + 1) % 100] + seq.token_ids[6:]
    assert ar_choices(model, prompt, wrong)[:6] == seq.token_ids[:6]


def test_calibration_rows(model_dir):
    model, tok = clover.load(model_dir)
    exs = [{"prompt": p, "budget": 16} for p in ("Copy: ab", "Sort: 2 1", "Add: 1+2")]
    with torch.inference_mode():
        rows = calibration(model, tok, exs, 4, [0.3, 0.99], batch=2)
    assert [r["threshold"] for r in rows] == [0.3, 0.99]
    for r in rows:
        assert 0 <= r["parallel"] <= r["tokens"] and 0 <= r["error_rate"] <= 1
        assert r["calibrated"] == (r["error_rate"] <= 1 - r["threshold"] + 1e-12)
    assert rows[0]["parallel"] > 0  # a peaked random model commits several at 0.3


def test_bench_calibration_cli(model_dir, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("clover.eval.pareto.examples", lambda n: [{"prompt": "Copy: ab", "answer": "ab", "task": "copy",
                                                                   "file": "copy", "budget": 8}])
    js = tmp_path / "c.json"
    assert main(["bench", "calibration", "--model", model_dir, "--thresholds", "0.5,0.9", "--block-size", "4",
                 "--threads", "1", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "| 0.5 |" in out and "| 0.9 |" in out and "calibrated" in out
    assert [r["threshold"] for r in json.loads(js.read_text())["results"]] == [0.5, 0.9]
    assert main(["bench", "calibration", "--model", model_dir, "--thresholds", "1.5"]) == 2
    assert main(["bench", "pareto", "--model", model_dir, "--modes", "ar,greedy"]) == 2
