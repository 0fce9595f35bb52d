"""bench/decode_breakdown.py's "if the model were perfect" figure, on a decode small enough to count by hand."""

import importlib
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture()
def breakdown(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports bench/step.py as `step`
    return importlib.import_module("decode_breakdown")


def test_a_perfect_model_fills_each_block_in_one_forward_at_the_measured_step_cost(breakdown):
    # block 2, one round, two prompts whose outputs have 3 and 4 tokens: measured 5 forwards (each
    # prompt's first, 6 columns; one 2-column step within a block; two 4-column commit + window steps)
    calls = {(6, 2, 2): [1.0, 1.0], (2, 2, 2): [0.5], (4, 2, 2): [0.8, 0.8]}
    fwd, host = 2.0 + 0.5 + 1.6, 1.0
    floor = lambda columns, logits: 0.1 * columns  # noqa: E731
    lc_floor = 2 * 0.6 + 0.2 + 2 * 0.4
    p = breakdown.perfect(2, 5, fwd + host, fwd, calls, {0: 3, 1: 4}, 1, floor, lc_floor)
    # perfect: ceil(3/2) + ceil(4/2) = 4 forwards: the two first ones as measured, two 4-column steps,
    # host time 0.2 a forward as measured
    assert p["forwards"] == 4 and p["step"] == 0.8
    assert p["seconds"] == pytest.approx(2.0 + 2 * 0.8 + 4 * 0.2)
    assert p["at_floor"] == pytest.approx(2 * 0.6 + 2 * 0.4)


def test_a_decode_that_never_committed_a_block_gives_no_figure(breakdown):
    calls = {(6, 2, 2): [1.0], (2, 2, 2): [0.5]}
    assert breakdown.perfect(2, 2, 2.0, 1.5, calls, {0: 2}, 1, lambda c, k: 0.1 * c, 0.8) is None
