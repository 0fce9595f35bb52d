"""Sizes computed without memory: parameter counts from a model built on the meta device, and the
per-token / per-sequence cache sizes that follow from the config."""

from __future__ import annotations

import torch

from .configuration_clover import CloverConfig

DIFFUSION_EXTRAS = ("right_conv", "block_calibration", "bidir_log_scale")


def model_stats(config: CloverConfig) -> dict:
    from .modeling_clover import CloverForBlockDiffusion

    with torch.device("meta"):
        model = CloverForBlockDiffusion(config)
    total = extras = expert = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if name.rsplit(".", 1)[-1] in DIFFUSION_EXTRAS:
            extras += n
        if ".mlp.experts." in name:
            expert += n
    c = config
    inactive = expert * (c.num_experts - c.num_experts_per_tok) // c.num_experts
    n_attn = sum(k == "full_attention" for k in c.layer_types)
    n_gdn = c.num_hidden_layers - n_attn
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    return {
        "total_params": total,
        "active_params": total - inactive,
        "backbone_params": total - extras,
        "backbone_active_params": total - extras - inactive,
        "diffusion_extra_params": extras,
        "bf16_weight_bytes": 2 * total,
        "kv_bytes_per_token": n_attn * 2 * c.num_key_value_heads * c.head_dim * 2,
        "gdn_state_bytes": n_gdn * (
            c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
            + conv_dim * (c.linear_conv_kernel_dim - 1) * 2
        ),
        "layers": {"full_attention": n_attn, "linear_attention": n_gdn},
        "max_position_embeddings": c.max_position_embeddings,
        "block_size": c.block_size,
    }
