"""The default recipe's files parse into what its stages need (recipes/default/make_model.py), so a typo
in recipe.toml fails here, not after hours of training."""

import importlib.util
import inspect
import tomllib
from pathlib import Path

import pytest
import torch

from clover.data.build import build_focus, recorded_rounds
from clover.training.trainer import TrainConfig

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "default"


@pytest.fixture(scope="module")
def make_model():
    spec = importlib.util.spec_from_file_location("make_model", RECIPE / "make_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_focus_round_splits_into_a_data_mix_and_trainer_options(make_model):
    rec = tomllib.loads((RECIPE / "recipe.toml").read_text())
    rounds = make_model.focus_rounds(rec)
    assert len(rounds) == len(rec["focus"]["rounds"]) >= 1
    data_params = set(inspect.signature(build_focus).parameters)
    for i, (mix, over) in enumerate(rounds):
        assert set(mix) <= data_params and not set(mix) & set(over)
        assert over["time_budget"] == rec["focus"]["rounds"][i]["time_budget"]
        cfg = make_model.stage_config(RECIPE / "focus.toml", **over)  # unknown trainer keys raise
        assert isinstance(cfg, TrainConfig)
    # a round's data keys override [focus]; the others fall back to it
    # fresh tool dialogues continue the base data's stream: each round starts where the last stopped
    custom = {"data": {"n_tool": 100},
              "focus": {"n_tasks": 10, "replay_frac": 0.5, "rounds": [
                  {"time_budget": 1.0, "n_tool": 30},
                  {"time_budget": 2.0, "n_decision": 7, "lr": 1e-4},
                  {"time_budget": 3.0, "n_tool": 5}]}}
    (mix1, over1), (mix2, over2), (mix3, _) = make_model.focus_rounds(custom)
    assert mix1 == {"n_tasks": 10, "replay_frac": 0.5, "n_tool": 30, "tool_start": 100} and over1 == {"time_budget": 1.0}
    assert mix2 == {"n_tasks": 10, "replay_frac": 0.5, "n_decision": 7, "tool_start": 130}
    assert over2 == {"time_budget": 2.0, "lr": 1e-4}
    assert mix3["tool_start"] == 130 and mix3["n_tool"] == 5
    (_, over1), (_, over2), _ = make_model.focus_rounds(custom, [5.0, 6.0, 7.0])
    assert (over1["time_budget"], over2["time_budget"]) == (5.0, 6.0)
    with pytest.raises(ValueError, match="needs 3 values"):
        make_model.focus_rounds(custom, [5.0])


@pytest.mark.parametrize("argv, message", [
    (["--focus-time-budgets"] + ["1"] * 9, "one per focus round"),
    (["--recipe", "no/such/recipe.toml"], "No such file"),
    (["--stop-after", "60"], "--stop-after is for --distill"),
])
def test_bad_flags_fail_before_any_work(make_model, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        make_model.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_is_a_clear_error(make_model, capsys):
    with pytest.raises(SystemExit) as e:
        make_model.main(["--device", "cuda"])
    assert e.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


def test_recorded_rounds_counts_consecutive_focus_stages():
    assert recorded_rounds({"ar_stage": {}, "bd_stage": {}}) == 0
    assert recorded_rounds({"focus_stage": {}, "focus2_stage": {}, "focus4_stage": {}}) == 2


def test_continue_needs_a_round_the_shipped_model_lacks(make_model, tmp_path, capsys):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "recipe.json").write_text('{"focus_stage": {}, "focus2_stage": {}}')
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'seed = 0\nrun_dir = "{tmp_path / "run"}"\nexport_dir = "{shipped}"\n'
                      '[data]\n[focus]\nrounds = [{ time_budget = 1 }, { time_budget = 1 }]\n')
    with pytest.raises(SystemExit, match="already has all 2 focus rounds"):
        make_model.main(["--recipe", str(recipe), "--continue"])
    assert not (tmp_path / "run").exists()  # failed before any work


def test_distill_step_prepares_a_valid_stage(make_model, tmp_path):
    """`make distill`'s preparation on a tiny recipe: the teacher copy, seeded prompts (none held out,
    every one with its task's budget) and a TrainConfig from distill.toml that validates."""
    import json

    from clover.data.build import heldout_tasks

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for name in ("config.json", "model.safetensors"):
        (shipped / name).write_text("x")
    data = {"n_train": 40, "n_decision": 4, "n_single_questions": 2, "n_tool": 2, "n_heldout": 30, "n_eval": 3,
            "chat_frac": 0.4, "think_frac": 0.3}
    rec = {"run_dir": str(tmp_path / "run"), "seed": 0, "data": data,
           "distill": {"n_prompts": 50, "chat_frac": 0.5, "time_budget": 60}}
    args = type("A", (), {"resume": False, "stop_after": 30.0})()
    cfg = make_model.distill(rec, args, {"seed": 0, "progress": False}, shipped)
    run = tmp_path / "run" / "distill"
    assert (run / "teacher" / "config.json").read_text() == "x" and cfg.objective == "distill"
    assert cfg.init == cfg.teacher == str(run / "teacher") and cfg.time_budget == 60 and cfg.stop_after == 30
    assert cfg.teacher_cache == str(run / "teacher_cache") and cfg.out_dir == str(run / "train")
    assert cfg.replay_files == [str(tmp_path / "run" / "data" / "train.jsonl")] and cfg.replay_frac > 0
    prompts = [json.loads(x) for x in (run / "prompts.jsonl").read_text().splitlines()]
    held = {e["prompt"] for e in heldout_tasks(0, 30, 3)}
    texts = [p["prompt"].rstrip("\n") if "prompt" in p else p["messages"][0]["content"] for p in prompts]
    assert len(prompts) == 50 and not set(texts) & held and all(p["max_new_tokens"] >= 8 for p in prompts)
    assert 0 < sum("messages" in p for p in prompts) < 50
    cfg.validate()
    again = tmp_path / "again.jsonl"
    from clover.data.build import build_distill_prompts

    build_distill_prompts(again, 0, 50, 0.5, 30, 3)
    assert again.read_bytes() == (run / "prompts.jsonl").read_bytes()  # seeded
