"""One settings object: DecodeConfig is frozen and holds every decoding default once; the server's
Settings and EngineKey, the lm-eval model and the tuner's fallback take theirs from it."""

import dataclasses
import inspect

import pytest

from clover.engine import DEFAULTS, DecodeConfig
from clover.engine.tuning import DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD
from clover.eval.generation import generate_until
from clover.server import EngineKey, Settings


def test_decode_config_is_frozen_and_derives_variants():
    cfg = DecodeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 4
    small = cfg.with_(block_size=4, max_new_tokens=7)
    assert (small.block_size, small.max_new_tokens, cfg.block_size) == (4, 7, DEFAULTS.block_size)
    with pytest.raises(ValueError, match="block_size"):
        cfg.with_(block_size=0).validate()


def test_every_default_comes_from_the_one_config():
    for obj in (Settings(), EngineKey()):
        assert (obj.mode, obj.block_size, obj.threshold) == (DEFAULTS.mode, DEFAULTS.block_size, DEFAULTS.threshold)
    key = EngineKey()
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
