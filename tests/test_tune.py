"""`clover tune` and `--block-size auto` on a tiny random model (the cache dir is a temp folder)."""

import json

import pytest

from clover.cli import main
from clover.engine import tuning
from helpers import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


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
    assert set(rates) == {2, 4} and out["block_size"] == max(rates, key=rates.get) and out["threshold"] == 0.5
    assert set(out["step_ms"]) == {"1", "2", "4"} and all(v > 0 for v in out["step_ms"].values())
    stored = json.loads((cache_home / "clover" / "tune.json").read_text())
    assert stored[out["model"]][out["machine"]]["block_size"] == out["block_size"]
    assert not list((cache_home / "clover").glob("*.tmp"))  # written by temp file + rename
    assert tuning.resolve_block_size("auto", model_dir) == (out["block_size"], 0.5)
    assert main(["generate", "--model", model_dir, "--prompt", "1+1=", "--block-size", "auto", "--max-new-tokens",
                 "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["forward_passes"] >= 1


def test_tune_user_mistakes_are_one_line(model_dir, capsys):
    assert main(["tune", "--model", model_dir, "--sizes", "1,4"]) == 2
    assert "block sizes must be in [2, 64]" in capsys.readouterr().err
