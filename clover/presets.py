"""The built-in presets and a torch-free view of a Clover config (`light_config`).

`clover info --preset ...` counts parameters and plans memory from these without importing torch
or transformers (clover/sizes.py); CloverConfig (clover/models/configuration_clover.py) takes its
presets, layer kinds and calibration anchors from here. `CONFIG_DEFAULTS` are CloverConfig's
keyword defaults (tests/test_sizes.py checks they stay equal).
"""

from __future__ import annotations

import ast
from types import SimpleNamespace

LAYER_KINDS = ("linear_attention", "full_attention")
# Block sizes at which the learnable bidirectional calibration has an anchor (log2-spaced); sizes in
# between interpolate linearly in log2, block size 1 has no bidirectional branch at all.
CALIBRATION_ANCHORS = (2, 4, 8, 16, 32, 64)

# The built-in sizes side by side, one field a line ("-": CloverConfig's default). clover-35b-a3b: the
# Qwen3.5/3.6-35B-A3B text backbone, exact published dims (docs/architecture.md section 1);
# clover-small: the benchmark / default-model dims (design notes section 5), ~20.5M params;
# clover-tiny: unit-test size, every layer kind, fast on two cores.
_SIZES = """
preset                            clover-35b-a3b  clover-small  clover-tiny
vocab_size                        248320          8192          128
hidden_size                       2048            256           64
num_hidden_layers                 40              8             4
num_attention_heads               16              4             4
num_key_value_heads               2               2             2
head_dim                          256             64            16
partial_rotary_factor             0.25            0.25          0.5
rope_theta                        10_000_000.0    10_000.0      10_000.0
linear_num_key_heads              16              2             2
linear_num_value_heads            32              4             4
linear_key_head_dim               128             64            16
linear_value_head_dim             128             64            16
linear_conv_kernel_dim            4               4             4
num_experts                       256             16            8
num_experts_per_tok               8               2             2
moe_intermediate_size             512             128           32
shared_expert_intermediate_size   512             256           32
max_position_embeddings           131072          4096          1024
rms_norm_eps                      1e-6            -             -
tie_word_embeddings               False           -             -
block_size                        32              32            8
mask_token_id                     248319          8191          127
"""


def _parse_sizes(table: str) -> dict[str, dict]:
    rows = [line.split() for line in table.strip().splitlines()]
    names = rows[0][1:]
    return {name: {row[0]: ast.literal_eval(row[1 + i]) for row in rows[1:] if row[1 + i] != "-"}
            for i, name in enumerate(names)}


PRESETS: dict[str, dict] = _parse_sizes(_SIZES)


# CloverConfig.__init__'s defaults for the fields a size depends on
CONFIG_DEFAULTS: dict = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, layer_types=None, full_attention_interval=4,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, attention_bias=False, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    max_position_embeddings=131072, tie_word_embeddings=False, block_size=32, max_block_size=64,
)


def num_calibration_anchors(max_block_size: int) -> int:
    return sum(1 for a in CALIBRATION_ANCHORS if a <= max(2, max_block_size))


def default_layer_types(num_hidden_layers: int, full_attention_interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
            for i in range(num_hidden_layers)]


def light_config(values: dict) -> SimpleNamespace:
    """The size-relevant fields of CloverConfig(**values), without transformers (presets are valid
    configs; a folder's config.json goes through CloverConfig, which checks it)."""
    c = {**CONFIG_DEFAULTS, **{k: v for k, v in values.items() if k in CONFIG_DEFAULTS}}
    if c["layer_types"] is None:
        c["layer_types"] = default_layer_types(c["num_hidden_layers"], c["full_attention_interval"])
    c["num_calibration_anchors"] = num_calibration_anchors(c["max_block_size"])
    return SimpleNamespace(**c)


def light_preset(name: str) -> SimpleNamespace:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return light_config(PRESETS[name])


# Public block-diffusion checkpoints (clover/models/families.py): the published config.json fields
# that sizes depend on. `clover info --preset NAME` counts them exactly; tests/test_families.py checks
# the counts against the published figures.
_QWEN3 = dict(vocab_size=151936, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
              max_position_embeddings=32768)
FAMILY_PRESETS: dict[str, dict] = {
    # JetLM/SDAR-1.7B-Chat (Qwen3-1.7B dims)
    "sdar-1.7b": dict(_QWEN3, architectures=["SDARForCausalLM"], model_type="sdar", hidden_size=2048,
                      intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                      tie_word_embeddings=True),
    # JetLM/SDAR-4B-Chat (Qwen3-4B dims)
    "sdar-4b": dict(_QWEN3, architectures=["SDARForCausalLM"], model_type="sdar", hidden_size=2560,
                    intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                    tie_word_embeddings=True),
    # JetLM/SDAR-8B-Chat (Qwen3-8B dims)
    "sdar-8b": dict(_QWEN3, architectures=["SDARForCausalLM"], model_type="sdar", hidden_size=4096,
                    intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                    tie_word_embeddings=False),
    # JetLM/SDAR-30B-A3B-Chat (Qwen3-30B-A3B dims)
    "sdar-30b-a3b": dict(_QWEN3, architectures=["SDARMoeForCausalLM"], model_type="sdar_moe", hidden_size=2048,
                         intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                         num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
    # inclusionAI/LLaDA2.0-mini and LLaDA2.1-mini (Ling-mini-2.0 dims)
    "llada2-mini": dict(architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", vocab_size=157184,
                        hidden_size=2048, intermediate_size=5120, num_hidden_layers=20, num_attention_heads=16,
                        num_key_value_heads=4, head_dim=128, num_experts=256, num_experts_per_tok=8,
                        num_shared_experts=1, n_group=8, topk_group=4, moe_intermediate_size=512,
                        first_k_dense_replace=1, use_bias=False, use_qkv_bias=False, use_qk_norm=True,
                        routed_scaling_factor=2.5, partial_rotary_factor=0.5, rope_theta=600000.0,
                        rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False),
    # Efficient-Large-Model/Fast_dLLM_v2_7B (Qwen2.5-7B-Instruct dims)
    "fast-dllm-v2-7b": dict(architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen",
                            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                            max_position_embeddings=32768, tie_word_embeddings=False, bd_size=32),
    # Efficient-Large-Model/Fast_dLLM_v2_1.5B (Qwen2.5-1.5B-Instruct dims)
    "fast-dllm-v2-1.5b": dict(architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen",
                              vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, rope_theta=1_000_000.0,
                              rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True, bd_size=32),
}
