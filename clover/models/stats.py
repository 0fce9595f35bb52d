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


GIB = 1024**3
RUNTIME_OVERHEAD_BYTES = 768 * 1024**2  # assumed: CUDA context, cuBLAS / allocator workspace


def int4_memory_plan(config: CloverConfig, group_size: int = 128, context: int | None = None,
                     quantize_head: bool = False, budget_bytes: int = 16 * GIB, batch: int = 1) -> dict:
    """Memory of an int4 deployment (`clover quantize` layout, tinygemm on a GPU: 4 bits per weight
    plus a bf16 (scale, zero) pair per group; everything not quantised in bf16), the caches of
    `batch` sequences of `context` tokens, and whether it fits `budget_bytes`. If not, how many
    bytes of routed experts would have to live in host memory."""
    from ..quant.modules import DEFAULT_NOT_QUANTIZED, quantized_targets
    from .modeling_clover import CloverForBlockDiffusion

    context = context or config.max_position_embeddings
    not_quantized = [m for m in DEFAULT_NOT_QUANTIZED if not (quantize_head and m == "lm_head")]
    with torch.device("meta"):
        model = CloverForBlockDiffusion(config)
    targets = [name + "." for name, _ in quantized_targets(model, not_quantized)]
    q_params = kept_params = expert_params = 0
    for name, p in model.named_parameters():
        if any(name.startswith(t) for t in targets):
            q_params += p.numel()
            expert_params += p.numel() if ".mlp.experts." in name else 0
        else:
            kept_params += p.numel()
    per_weight = 0.5 + 4 / group_size  # int4 value + bf16 (scale, zero) per group
    int4_bytes = round(q_params * per_weight)
    expert_bytes = round(expert_params * per_weight)
    kept_bytes = 2 * kept_params
    weights = int4_bytes + kept_bytes
    s = model_stats(config)
    kv = s["kv_bytes_per_token"] * context * batch
    gdn = s["gdn_state_bytes"] * batch
    logits = config.block_size * config.vocab_size * 6 * batch  # bf16 logits + fp32 softmax of one block
    overhead = RUNTIME_OVERHEAD_BYTES + logits
    total = weights + kv + gdn + overhead
    over = max(0, total - budget_bytes)
    offload = min(over, expert_bytes)
    fits = over == 0
    active_expert_bytes = expert_bytes * config.num_experts_per_tok // config.num_experts
    if fits:
        answer = (f"yes: {total / GIB:.2f} GiB of {budget_bytes / GIB:.0f} GiB at {context:,} tokens "
                  f"(batch {batch}), {(budget_bytes - total) / GIB:.2f} GiB to spare")
    elif over <= expert_bytes:
        answer = (f"not entirely: {total / GIB:.2f} GiB needed at {context:,} tokens (batch {batch}); "
                  f"{offload / GIB:.2f} GiB of routed experts ({offload / expert_bytes:.0%} of them) must stay in "
                  f"host memory and be streamed on use (~{offload / expert_bytes * active_expert_bytes / 1e6:.0f} MB "
                  f"per token under uniform routing, {active_expert_bytes / 1e6:.0f} MB at worst)")
    else:
        answer = f"no: {total / GIB:.2f} GiB needed, {over / GIB:.2f} GiB over even with every routed expert in host memory"
    return {
        "quant": "int4", "group_size": group_size, "quantize_head": quantize_head,
        "bits_per_quantized_weight": 8 * per_weight,
        "context": context, "batch": batch,
        "int4_params": q_params, "bf16_params": kept_params,
        "int4_weight_bytes": int4_bytes, "bf16_weight_bytes": kept_bytes,
        "routed_expert_bytes": expert_bytes, "weight_bytes": weights,
        "weight_ratio_vs_bf16": weights / s["bf16_weight_bytes"],
        "quantized_layers_ratio_vs_bf16": per_weight / 2,
        "kv_cache_bytes": kv, "gdn_state_bytes": gdn,
        "runtime_overhead_bytes": overhead,
        "runtime_overhead_note": "assumed: 768 MiB CUDA context / workspaces + one block of logits",
        "total_bytes": total, "budget_bytes": budget_bytes,
        "fits": fits, "experts_in_host_memory_bytes": offload,
        "experts_in_host_memory_fraction": offload / expert_bytes if expert_bytes else 0.0,
        "active_expert_bytes_per_token": active_expert_bytes,
        "answer": answer,
    }
