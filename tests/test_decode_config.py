"""One settings object: DecodeConfig (clover.settings, torch-free) is frozen and holds every decoding
default once; the server's Settings holds one whole, its engine keys are DecodeConfigs, the lm-eval
model and the tuner's fallback take theirs from it; one infill threshold default."""

import dataclasses
import inspect

import pytest

from clover.engine import DEFAULTS, DecodeConfig
from clover.engine.tuning import DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD
from clover.eval.generation import generate_until
from clover.server import Settings
from clover.settings import INFILL_THRESHOLD


def test_decode_config_is_frozen_and_derives_variants():
    cfg = DecodeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 4
    small = cfg.with_(block_size=4, max_new_tokens=7)
    assert (small.block_size, small.max_new_tokens, cfg.block_size) == (4, 7, DEFAULTS.block_size)
    with pytest.raises(ValueError, match="block_size"):
        cfg.with_(block_size=0).validate()


def test_every_default_comes_from_the_one_config():
    for obj in (Settings().decode, DEFAULTS.engine_key()):
        assert (obj.mode, obj.block_size, obj.threshold) == (DEFAULTS.mode, DEFAULTS.block_size, DEFAULTS.threshold)
    assert Settings().decode.runner == DEFAULTS.runner
    key = DEFAULTS.engine_key().sampling
    assert (key.temperature, key.top_p, key.top_k) == (DEFAULTS.sampling.temperature, DEFAULTS.sampling.top_p,
                                                       DEFAULTS.sampling.top_k)
    assert (DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD) == (DEFAULTS.block_size, DEFAULTS.threshold)
    params = inspect.signature(generate_until).parameters
    assert (params["block_size"].default, params["threshold"].default) == (DEFAULTS.block_size, DEFAULTS.threshold)
    pytest.importorskip("lm_eval")
    from clover.eval.lm import CloverLM

    params = inspect.signature(CloverLM.__init__).parameters
    assert (params["block_size"].default, params["threshold"].default, params["mode"].default) == (
        DEFAULTS.block_size, DEFAULTS.threshold, DEFAULTS.mode)


def test_a_config_is_checked_when_made_and_built_from_flat_settings():
    with pytest.raises(ValueError, match="unknown mode"):
        DecodeConfig(mode="fast")
    cfg = DecodeConfig.from_settings(threshold="0.5", block_size="8", steps="None", temperature=0.7, seed=3, mode=None)
    assert (cfg.threshold, cfg.block_size, cfg.steps, cfg.mode) == (0.5, 8, None, DEFAULTS.mode)
    assert (cfg.sampling.temperature, cfg.sampling.seed, cfg.sampling.top_p) == (0.7, 3, DEFAULTS.sampling.top_p)
    assert DecodeConfig.from_settings() == DEFAULTS
    assert DecodeConfig.from_settings(cfg, top_k=5).sampling == dataclasses.replace(cfg.sampling, top_k=5)
    for bad, why in [(dict(speed=2), "unknown decoding setting 'speed'"), (dict(block_size="x"), "block_size must be a number"),
                     (dict(top_p=0), "top_p")]:
        with pytest.raises(ValueError, match=why):
            DecodeConfig.from_settings(**bad)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_cli_flags_build_the_config_through_one_helper(command):
    from clover.cli import build_parser
    from clover.cli.options import decode_config
    from clover.errors import UserError

    argv = [command] + (["--prompt", "x"] if command == "generate" else [])
    got = decode_config(build_parser().parse_args(argv))
    want = DEFAULTS.with_(max_new_tokens=512) if command == "chat" else DEFAULTS  # chat's longer replies
    assert got == want
    got = decode_config(build_parser().parse_args(argv + ["--threshold", "0.7", "--mode", "ar"]))
    assert (got.threshold, got.mode) == (0.7, "ar")
    with pytest.raises(UserError, match="unknown mode"):
        decode_config(build_parser().parse_args(argv + ["--mode", "fast"]))


def test_api_takes_a_config_or_keyword_settings():
    from clover.api import decode_config
    from helpers import tiny_model, tiny_tokenizer

    model, tok = tiny_model(0), tiny_tokenizer()
    cfg = decode_config(model, tok, DEFAULTS.with_(block_size=4), threshold=0.5)
    assert (cfg.block_size, cfg.threshold) == (4, 0.5) and cfg.eos_token_ids
    with pytest.raises(TypeError):
        decode_config(model, tok, 16, 4)  # the settings are keyword-only


def test_settings_are_torch_free_and_name_the_engines_policies_and_runners():
    import subprocess
    import sys

    code = "import sys, clover.settings; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    from clover.engine.policies import SCORES
    from clover.engine.runner import RUNNERS
    from clover.settings import POLICIES, RUNNERS as NAMES

    assert tuple(SCORES) == POLICIES and tuple(RUNNERS) == NAMES


def test_one_infill_default_and_one_block_size_check():
    """decide, structured output, the server and the CLI share INFILL_THRESHOLD; a server given a
    threshold commits slots at it too. The block size is checked against the model in one place."""
    import re
    from pathlib import Path

    import clover
    from clover.cli import build_parser
    from clover.decision import decide
    from clover.structured import generate_json
    from clover.structured.generate import infill_json

    from types import SimpleNamespace

    from clover.settings import infill_settings

    assert inspect.signature(infill_json).parameters["threshold"].default == INFILL_THRESHOLD
    for fn in (decide, generate_json):  # None: infill_settings picks (a public family: its published one)
        assert inspect.signature(fn).parameters["threshold"].default is None
    clover_model, family = SimpleNamespace(), SimpleNamespace(block_align="absolute")
    assert infill_settings(clover_model, None, None) == (INFILL_THRESHOLD, 32)
    assert infill_settings(clover_model, 0.5, 8) == (0.5, 8) and infill_settings(family, None, None) == (None, None)
    assert build_parser().parse_args(["decide", "--material", "m", "--questions", "q"]).threshold is None  # decide's
    assert Settings().infill_threshold == INFILL_THRESHOLD and Settings(threshold=0.5).infill_threshold == 0.5
    assert Settings(threshold=0.5).decode.threshold == 0.5
    root = Path(clover.__file__).parent
    checks = [str(p.relative_to(root)) for p in root.rglob("*.py") if "block_size must be in [" in p.read_text()
              or "block-size must be in [" in p.read_text()]
    assert checks == ["settings.py"], checks
    slot_users = [root / d for d in ("decision", "structured", "server", "cli", "benchmarks", "engine")]
    literal = [f"{p.relative_to(root)}" for d in slot_users for p in d.rglob("*.py")
               if re.search(r"threshold(: float)? ?= ?0\.9\b", p.read_text())]
    assert literal == []
