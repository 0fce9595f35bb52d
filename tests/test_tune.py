"""`clover tune` and `--block-size auto` on a tiny random model (the cache dir is a temp folder)."""

import json

import pytest

from clover.cli import main
from clover.engine import tuning


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def test_nothing_tuned_gives_the_announced_defaults(model_dir):
    assert tuning.resolve_block_size("auto", model_dir) == (32, 0.95)
    assert tuning.resolve_block_size(16, model_dir) == (16, None)


def test_tune_stores_the_fastest_setting_and_auto_uses_it(model_dir, capsys, cache_home, monkeypatch):
    monkeypatch.setattr("clover.eval.pareto.examples", lambda n: [
        {"prompt": "2+3=", "answer": "5", "task": "add", "budget": 8},
        {"prompt": "7+1=", "answer": "8", "task": "add", "budget": 8}])
    assert main(["tune", "--model", model_dir, "--sizes", "2,4", "--thresholds", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rates = {r["block_size"]: r["tokens_per_second"] for r in out["curve"]}
    ref = out["reference"]  # low_confidence at the announced defaults: the accuracy a setting must keep
    assert (ref["block_size"], ref["threshold"]) == (32, 0.95) and 0 <= ref["accuracy"] <= 1
    ok = {r["block_size"]: r["tokens_per_second"] for r in out["curve"] if r["accuracy"] >= ref["accuracy"] - 0.02}
    assert set(rates) == {2, 4} and out["threshold"] == 0.5
    assert out["block_size"] == (max(ok, key=ok.get) if ok else 32)
    assert set(out["step_ms"]) == {"1", "2", "4"} and all(v > 0 for v in out["step_ms"].values())
    stored = json.loads((cache_home / "clover" / "tune.json").read_text())
    assert stored[out["model"]][out["machine"]]["block_size"] == out["block_size"]
    assert not list((cache_home / "clover").glob("*.tmp"))  # written by temp file + rename
    assert tuning.resolve_block_size("auto", model_dir) == (out["block_size"], 0.5)
    assert main(["generate", "--model", model_dir, "--prompt", "1+1=", "--block-size", "auto", "--max-new-tokens",
                 "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["forward_passes"] >= 1
    from clover.cli import build_parser
    from clover.cli.serve import check_args

    args = build_parser().parse_args(["serve", "--model", model_dir, "--block-size", "auto"])
    check_args(args)  # serve resolves auto at startup, before it loads the model, as generate does
    assert (args.block_size, args.threshold) == (out["block_size"], 0.5)


def test_tune_user_mistakes_are_one_line(model_dir, capsys):
    assert main(["tune", "--model", model_dir, "--sizes", "1,4"]) == 2
    assert "block sizes must be in [2, 64]" in capsys.readouterr().err


def test_tune_picks_the_fastest_setting_within_two_points_of_the_defaults(monkeypatch):
    # (block, threshold) -> (tokens/s, accuracy); the fastest loses 3 points, the next only 2
    table = {(1, 0.95): (10, 0.60), (8, 0.5): (50, 0.57), (8, 0.9): (40, 0.58), (16, 0.9): (30, 0.61), (16, 0.5): (45, 0.50),
             (32, 0.95): (20, 0.60)}
    calls = []

    def fake_rate(model, jobs, eos, mode, block, threshold, runner="eager", score=None):
        calls.append((block, threshold))
        rate, acc = table[(block, threshold)]
        return dict(block_size=block, threshold=threshold, tokens_per_second=rate, accuracy=acc)

    monkeypatch.setattr(tuning, "decode_rate", fake_rate)
    monkeypatch.setattr(tuning, "step_ms", lambda model, sizes, runner="eager": {n: 1.0 for n in sizes})
    got = tuning.tune(None, [], (), sizes=(8, 16), thresholds=(0.5, 0.9), score=lambda i, ids: True)
    assert (got["block_size"], got["threshold"]) == (8, 0.9)
    assert (32, 0.95) in calls and got["reference"]["accuracy"] == 0.60  # off the grid: measured apart
    unscored = tuning.tune(None, [], (), sizes=(8, 16), thresholds=(0.5, 0.9))
    assert (unscored["block_size"], unscored["threshold"]) == (8, 0.5)  # no scorer: the fastest


def test_compiled_tuning_warms_each_block_size_before_timing_it(monkeypatch):
    """A compiled runner's first decode at a block size compiles its graphs (seconds): that run is a
    warm-up, not a measurement (it made the compiled curve 100x noisy); eager is measured at once."""
    calls = []

    def fake_rate(model, jobs, eos, mode, block, threshold, runner="eager", score=None):
        calls.append((mode, block, threshold, score is not None))
        return dict(block_size=block, threshold=threshold, tokens_per_second=block, accuracy=1.0)

    monkeypatch.setattr(tuning, "decode_rate", fake_rate)
    monkeypatch.setattr(tuning, "step_ms", lambda model, sizes, runner="eager": {n: 1.0 for n in sizes})
    score = lambda i, ids: True  # noqa: E731
    ticks = []
    tuning.tune(None, [], (), sizes=(8, 16), thresholds=(0.5, 0.9), runner="compiled", score=score,
                progress=lambda done, total: ticks.append((done, total)))
    assert ticks == [(i + 1, len(calls)) for i in range(len(calls))]  # one tick per decode of the set, warm-ups too
    measured = [c[:3] for c in calls if c[3]]
    warmups = [c[:2] for c in calls if not c[3]]
    assert warmups == [("ar", 1), ("low_confidence", 8), ("low_confidence", 16), ("low_confidence", 32)]
    for mode, block, _ in measured:  # every measurement comes after its block size's warm-up
        first = next(i for i, c in enumerate(calls) if c[:2] == (mode, block))
        assert not calls[first][3]
    calls.clear()
    tuning.tune(None, [], (), sizes=(8, 16), thresholds=(0.5, 0.9), runner="eager", score=score)
    assert all(c[3] for c in calls)


def test_tuning_interleaves_rounds_and_keeps_each_settings_median(monkeypatch):
    """ar and every low_confidence setting are decoded once per round, round after round (so a burst
    of load from elsewhere hits all alike), and each keeps the median of its rounds."""
    calls, speeds = [], {}

    def fake_rate(model, jobs, eos, mode, block, threshold, runner="eager", score=None):
        calls.append((mode, block, threshold))
        n = speeds[(mode, block, threshold)] = speeds.get((mode, block, threshold), 0) + 1
        rate = {1: 10.0, 2: 1000.0, 3: 30.0}[n] * block  # round 2 is a burst: the median ignores it
        return dict(block_size=block, threshold=threshold, tokens_per_second=rate, accuracy=1.0)

    monkeypatch.setattr(tuning, "decode_rate", fake_rate)
    monkeypatch.setattr(tuning, "step_ms", lambda model, sizes, runner="eager": {n: 1.0 for n in sizes})
    got = tuning.tune(None, [], (), sizes=(8, 16), thresholds=(0.9,), rounds=3)
    one_round = [("ar", 1, 0.95), ("low_confidence", 8, 0.9), ("low_confidence", 16, 0.9)]
    assert calls == one_round * 3
    assert got["ar"]["tokens_per_second"] == 30.0 and got["rounds"] == 3
    assert [r["tokens_per_second"] for r in got["curve"]] == [240.0, 480.0]


def test_tune_says_when_a_compiled_measurement_ran_eagerly(model_dir, capsys, monkeypatch):
    """A compiled runner past dynamo's recompile limit runs new shapes eagerly: the table must not pass
    those speeds off as the compiled runner's."""
    def row(block, threshold, eager_calls):
        return dict(block_size=block, threshold=threshold, tpf=2.0, tokens_per_second=100.0, accuracy=0.5,
                    eager_calls=eager_calls)

    entry = dict(block_size=8, threshold=0.9, runner="compiled", ar=row(1, 0.95, 0), rounds=1, prompts=2,
                 curve=[row(8, 0.9, 0), row(16, 0.9, 3)], reference=row(32, 0.95, 0), step_ms={"1": 1.0, "8": 1.0, "16": 1.0})
    monkeypatch.setattr(tuning, "tune", lambda *a, **k: entry)
    monkeypatch.setattr("clover.eval.pareto.examples", lambda n: [{"prompt": "2+3=", "answer": "5", "task": "add", "budget": 8}])
    assert main(["tune", "--model", model_dir, "--runner", "compiled", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "ran eagerly" in out and "16 / 0.9 (3)" in out and "8 / 0.9 (" not in out
    entry["curve"][1]["eager_calls"] = 0
    assert main(["tune", "--model", model_dir, "--runner", "compiled", "--dry-run"]) == 0
    assert "ran eagerly" not in capsys.readouterr().out


def test_cli_defaults_are_the_tuning_defaults():
    """clover/cli/tune.py spells the grid as text (it keeps torch out of `--help`); it must be the grid
    tuning.tune tries by default."""
    import inspect

    from clover.cli import tune as cli_tune

    grid = inspect.signature(tuning.tune).parameters
    assert tuple(int(b) for b in cli_tune.SIZES.split(",")) == grid["sizes"].default
    assert tuple(float(t) for t in cli_tune.THRESHOLDS.split(",")) == grid["thresholds"].default == tuning.THRESHOLDS
    assert cli_tune.ROUNDS == grid["rounds"].default
