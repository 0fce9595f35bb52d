"""clover/sizes.py counts parameters from the config alone: its shapes must be the model's. The
reference is CloverForBlockDiffusion built on the meta device, on every preset and on odd random
configs; the torch-free config view (clover.presets) must read a config as CloverConfig does."""

from __future__ import annotations

import inspect
import math
import random

import pytest
import torch

from clover.models import PRESETS, CloverConfig, CloverForBlockDiffusion, preset_config
from clover.presets import CONFIG_DEFAULTS, light_config, light_preset
from clover.sizes import model_stats, param_shapes, train_memory_plan


def meta_shapes(config) -> dict:
    with torch.device("meta"):
        model = CloverForBlockDiffusion(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def random_values(rng: random.Random) -> dict:
    kv = rng.choice([1, 2, 3])
    kh = rng.choice([1, 2, 3])
    layers = rng.randint(1, 7)
    v = dict(vocab_size=rng.randint(17, 300), hidden_size=rng.choice([24, 40, 56]), num_hidden_layers=layers,
             num_attention_heads=kv * rng.randint(1, 3), num_key_value_heads=kv, head_dim=rng.choice([8, 12, 20]),
             partial_rotary_factor=0.5, linear_num_key_heads=kh, linear_num_value_heads=kh * rng.randint(1, 3),
             linear_key_head_dim=rng.choice([5, 8, 12]), linear_value_head_dim=rng.choice([6, 8, 11]),
             linear_conv_kernel_dim=rng.randint(2, 5), num_experts=rng.randint(1, 9), moe_intermediate_size=rng.randint(3, 40),
             shared_expert_intermediate_size=rng.choice([0, 7, 16]), attention_bias=rng.random() < 0.5,
             tie_word_embeddings=rng.random() < 0.5, max_block_size=rng.choice([1, 3, 8, 16, 100]),
             max_position_embeddings=rng.randint(16, 999), full_attention_interval=rng.randint(1, 4))
    v["num_experts_per_tok"] = rng.randint(1, v["num_experts"])
    v["block_size"] = rng.randint(1, v["max_block_size"])
    if rng.random() < 0.4:
        v["layer_types"] = [rng.choice(["full_attention", "linear_attention"]) for _ in range(layers)]
    return v


CASES = [("preset", name) for name in sorted(PRESETS)] + [("random", seed) for seed in range(12)]


@pytest.mark.parametrize("kind,key", CASES)
def test_param_shapes_equal_the_meta_model(kind, key):
    values = PRESETS[key] if kind == "preset" else random_values(random.Random(key))
    config = CloverConfig(**values)
    ref = meta_shapes(config)
    light = light_config(values)
    for fields in (config, light):
        got = param_shapes(fields)
        assert list(got.items()) == list(ref.items())  # same names, shapes and order
    assert model_stats(light) == model_stats(config)
    assert model_stats(config)["total_params"] == sum(math.prod(shape) for shape in ref.values())
    assert train_memory_plan(light, gpus=3, seq_len=17) == train_memory_plan(config, gpus=3, seq_len=17)
    for name in set(CONFIG_DEFAULTS) - {"full_attention_interval"}:  # CloverConfig keeps only layer_types
        assert getattr(light, name) == getattr(config, name), name
    assert light.num_calibration_anchors == config.num_calibration_anchors


def test_light_preset_is_the_preset_and_defaults_are_cloverconfigs():
    defaults = {n: p.default for n, p in inspect.signature(CloverConfig.__init__).parameters.items()
                if n in CONFIG_DEFAULTS}
    assert defaults == CONFIG_DEFAULTS
    for name in PRESETS:
        assert vars(light_preset(name)) == vars(light_config(PRESETS[name]))
        assert model_stats(light_preset(name)) == model_stats(preset_config(name))
    with pytest.raises(ValueError, match="unknown preset"):
        light_preset("nope")
