"""bench/tool_calls.py's estimate of what an exact prefix cache would save: a job lays its context out in
clean windows of its first window's width anchored at the context's end, so a snapshot after P tokens
serves only a later job of the same width whose window boundaries fall on P (no model is run)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_tool_calls", ROOT / "bench" / "tool_calls.py")
tool_calls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool_calls)


def ctx(shared: int, tail: int = 0, tag: int = 1) -> tuple:
    """`shared` tokens every context has, then `tail` of its own."""
    return tuple(range(shared)) + tuple(1000 * tag + t for t in range(tail))


def test_a_snapshot_serves_only_jobs_of_the_same_width_and_alignment():
    savings = tool_calls.cache_savings
    assert savings([(4, ctx(20, 3)), (4, ctx(20, 3))]) == (23, 46)  # the same context again: all of it
    assert savings([(4, ctx(20, 4, 1)), (4, ctx(20, 8, 2))]) == (20, 40)  # both lay windows out from 0: 20 shared
    assert savings([(4, ctx(20, 5, 1)), (4, ctx(20, 9, 2))])[0] == 17  # 25 - 4k and 29 - 4k meet on 17
    assert savings([(4, ctx(20, 5, 1)), (4, ctx(20, 8, 2))])[0] == 0  # 25 - 4k and 28 - 4k never meet
    assert savings([(4, ctx(20, 4, 1)), (5, ctx(20, 5, 2))])[0] == 0  # another width: nothing
    # the shared prefix cached at every alignment: each job keeps its last boundary inside it
    assert savings([(4, ctx(20, 5, 1)), (4, ctx(20, 6, 2))]) == (0, 17 + 18)
    assert savings([(3, ctx(6)), (3, ctx(6, 1))]) == (0, 6 + 4)


def test_model_and_size_large_together_are_a_one_line_usage_error(monkeypatch, capsys):
    import pytest

    monkeypatch.setattr("sys.argv", ["tool_calls.py", "--model", "somewhere", "--size", "large"])
    with pytest.raises(SystemExit) as e:
        tool_calls.main()
    assert e.value.code == 2 and "give one" in capsys.readouterr().err


def test_jobs_in_step_share_only_prefixes_of_one_width_and_phase():
    """The k-th jobs of the requests, side by side: rows of one width and phase share up to a boundary of each."""
    rec = lambda w, ctx: (1, len(ctx), 0, w, 0.0, (w, tuple(ctx)))  # noqa: E731 - a job's first forward
    a, b, c = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 9, 9, 9, 9], [1, 2, 3, 8]
    assert tool_calls.step_savings([[rec(2, a)], [rec(2, b)]]) == 5  # one phase modulo 2: 5 tokens once
    assert tool_calls.step_savings([[rec(4, a)], [rec(4, b)]]) == 0  # phases 3 and 1 modulo 4
    assert tool_calls.step_savings([[rec(2, a)], [rec(3, b)]]) == 0  # two widths
    assert tool_calls.step_savings([[rec(2, c), rec(2, a)], [rec(2, a), rec(2, b)]]) == 5  # second jobs only
