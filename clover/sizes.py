"""Sizes computed without memory: exact parameter counts from the config (`param_shapes`, the
shapes CloverForBlockDiffusion's parameters have, by name), the per-token / per-sequence cache sizes
that follow from it, and memory plans. Torch-free except the int4 plan (which asks the quantiser
which modules it replaces, on a meta-device model) and the serve plan (the loader's shard plan,
clover/distributed/parallel.py); `config` is a CloverConfig or a `clover.presets.light_config`.
tests/test_sizes.py checks `param_shapes` against a meta-device model."""

from __future__ import annotations

from typing import Any

CloverConfig = Any  # a CloverConfig or its torch-free view (clover.presets.light_config)

DIFFUSION_EXTRAS = ("right_conv", "block_calibration", "bidir_log_scale")


def param_shapes(config: CloverConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every parameter of CloverForBlockDiffusion(config), in its order (a tied
    lm_head is the embedding: not listed twice), from the config alone."""
    c = config
    h, e, inter, si = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    hv, kd, vd = c.linear_num_value_heads, c.linear_num_key_heads * c.linear_key_head_dim, \
        c.linear_num_value_heads * c.linear_value_head_dim
    conv, kernel = 2 * kd + vd, c.linear_conv_kernel_dim
    out = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        if kind == "full_attention":
            a = p + "self_attn."
            out[a + "qkv_proj.weight"] = (2 * q + 2 * kv, h)
            if c.attention_bias:
                out[a + "qkv_proj.bias"] = (2 * q + 2 * kv,)
            out[a + "o_proj.weight"] = (h, q)
            if c.attention_bias:
                out[a + "o_proj.bias"] = (h,)
            out[a + "q_norm.weight"] = out[a + "k_norm.weight"] = (c.head_dim,)
        else:
            g = p + "linear_attn."
            out.update({g + "dt_bias": (hv,), g + "A_log": (hv,), g + "right_conv": (conv, kernel - 1),
                        g + "block_calibration": (c.num_calibration_anchors, hv), g + "bidir_log_scale": (hv,),
                        g + "in_proj.weight": (conv + vd + 2 * hv, h), g + "conv1d.weight": (conv, 1, kernel),
                        g + "norm.weight": (c.linear_value_head_dim,), g + "out_proj.weight": (h, vd)})
        m = p + "mlp."
        out.update({m + "gate.weight": (e, h), m + "experts.gate_up_proj": (e, 2 * inter, h),
                    m + "experts.down_proj": (e, h, inter)})
        if si:
            out.update({m + "shared_expert.gate_up_proj.weight": (2 * si, h),
                        m + "shared_expert.down_proj.weight": (h, si), m + "shared_expert_gate.weight": (1, h)})
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    return out


def model_stats(config: CloverConfig) -> dict:
    total = extras = expert = 0
    for name, shape in param_shapes(config).items():
        n = _numel(shape)
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
    import torch

    from .models.modeling_clover import CloverForBlockDiffusion
    from .quant.modules import DEFAULT_NOT_QUANTIZED, quantized_targets

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


# ------------------------------------------------------------------------------------------------
# Memory plans across GPUs (clover/distributed, docs/distributed.md)
# ------------------------------------------------------------------------------------------------
def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def activation_bytes_per_token(config: CloverConfig, block: int) -> dict:
    """bf16 activations one decoder layer keeps for its backward, per token of the training layout
    ([x_t ; x_0]: 2 tokens per position), by kind of layer; an estimate from the tensors the
    forward saves (fp32 where the code computes in fp32: router, GDN q/k/g/beta, chunk states)."""
    c = config
    h, k, inter, si, e = c.hidden_size, c.num_experts_per_tok, c.moe_intermediate_size, \
        c.shared_expert_intermediate_size, c.num_experts
    qd, kvd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    kd, vd = c.linear_num_key_heads * dk, hv * dv
    conv = 2 * kd + vd
    common = 2 * (3 * h)  # two norm outputs + the residual
    moe = 4 * 2 * e + 2 * (k * h + k * 2 * inter + k * inter + k * h) + 2 * (2 * si + si + h)
    attn = 2 * ((2 * qd + 2 * kvd) + (qd + kvd) + 3 * qd)  # qkv, roped q/k, attention out, gated, o_proj in
    gdn = (2 * ((conv + vd + 2 * hv) + 2 * conv + 2 * vd)  # in_proj out, conv out + act, core / normed
           + 4 * (2 * hv * dk + hv * dv + 2 * hv)  # q, k (per value head), v, g, beta in fp32
           + 4 * hv * dk * dv / max(block, 1))  # the chunk-start states (one per window)
    return {"full_attention": common + attn + moe, "linear_attention": common + gdn + moe}


def train_memory_plan(config: CloverConfig, gpus: int = 8, budget_bytes: int = 80 * GIB, seq_len: int = 4096,
                      micro_batch: int = 1, block: int = 32, recompute: bool = True) -> dict:
    """Per-GPU memory of `clover train` under FSDP2 over `gpus` ranks (clover/distributed/fsdp.py):
    fp32 master weights, fp32 gradients and AdamW's two fp32 moments, each sharded along dim 0
    (ceil(dim0 / gpus) rows per rank, FSDP's padding included); bf16 all-gathered parameters of two
    decoder layers at a time (the running one and the prefetched next) and of the root group
    (embeddings, head), the unsharded fp32 gradients of one layer before its reduce-scatter;
    activations of `micro_batch` rows of `seq_len` tokens in the [x_t ; x_0] layout (2 seq_len
    tokens per row), with per-layer recomputation (each layer keeps its input; one layer's
    internals live at a time) or without (every layer keeps its internals); the head's logits of
    the noisy half (bf16 logits, fp32 log-softmax and its gradient)."""
    if gpus < 1 or seq_len < 1 or micro_batch < 1:
        raise ValueError("gpus, seq_len and micro_batch must be >= 1")
    shapes = param_shapes(config)
    shard_elems = sum(-(-s[0] // gpus) * _numel(s[1:]) for s in shapes.values())
    total = sum(_numel(s) for s in shapes.values())
    layer = [0] * config.num_hidden_layers
    for name, s in shapes.items():
        if name.startswith("model.layers."):
            layer[int(name.split(".")[2])] += _numel(s)
    root = total - sum(layer)
    biggest = max(layer)
    weights, grads, optim = 4 * shard_elems, 4 * shard_elems, 8 * shard_elems
    gathered = 2 * (2 * biggest) + 2 * root + 4 * biggest + 4 * root
    tokens = micro_batch * 2 * seq_len
    per_tok = activation_bytes_per_token(config, block)
    kinds = config.layer_types
    keep_inputs = len(kinds) * tokens * config.hidden_size * 2
    if recompute:
        acts = keep_inputs + tokens * max(per_tok[k] for k in set(kinds))
    else:
        acts = keep_inputs + tokens * sum(per_tok[k] for k in kinds)
    logits = micro_batch * seq_len * config.vocab_size * (2 + 4 + 4)
    total_bytes = round(weights + grads + optim + gathered + acts + logits + RUNTIME_OVERHEAD_BYTES)
    return _verdict({
        "plan": "train", "gpus": gpus, "parallel": f"FSDP2 over {gpus}", "seq_len": seq_len,
        "micro_batch": micro_batch, "block_size": block, "recompute": recompute,
        "total_params": total, "params_per_rank": shard_elems,
        "weight_bytes": weights, "grad_bytes": grads, "optimizer_bytes": optim,
        "gathered_bytes": gathered, "activation_bytes": round(acts), "logits_bytes": logits,
        "runtime_overhead_bytes": RUNTIME_OVERHEAD_BYTES, "total_bytes": total_bytes,
    }, budget_bytes)


def serve_memory_plan(config: CloverConfig, gpus: int = 8, budget_bytes: int = 80 * GIB, context: int | None = None,
                      batch: int = 1, tp: int = 1, ep: int | None = None) -> dict:
    """Per-GPU memory of `clover generate/serve --tp/--ep` (clover/distributed/parallel.py): bf16
    weights of one rank's shard, counted from the same shard plan the loader reads (the largest
    rank), K/V of `batch` sequences of `context` tokens and their GDN states (split by --tp,
    replicated under --ep), the runtime overhead and one block of logits."""
    from .distributed.plan import check_parallel, local_shape, shard_plan

    if ep is None:
        ep = gpus if tp == 1 else 1
    if max(tp, ep) != gpus:
        raise ValueError(f"--tp {tp} / --ep {ep} do not use {gpus} GPUs (one of them must equal --gpus)")
    check_parallel(config, tp, ep)
    context = context or config.max_position_embeddings
    shapes = param_shapes(config)
    plan = shard_plan(config, tp, ep, 0)
    params = sum(_numel(local_shape(s, plan.get(n))) for n, s in shapes.items())
    s = model_stats(config)
    weights = 2 * params
    kv = s["kv_bytes_per_token"] * context * batch // tp
    gdn = s["gdn_state_bytes"] * batch // tp
    logits = config.block_size * config.vocab_size * 6 * batch
    total = weights + kv + gdn + RUNTIME_OVERHEAD_BYTES + logits
    return _verdict({
        "plan": "serve", "gpus": gpus, "tp": tp, "ep": ep,
        "parallel": f"tensor parallel {tp}" if tp > 1 else (f"expert parallel {ep}" if ep > 1 else "one GPU"),
        "context": context, "batch": batch, "total_params": s["total_params"], "params_per_rank": params,
        "weight_bytes": weights, "kv_cache_bytes": kv, "gdn_state_bytes": gdn, "logits_bytes": logits,
        "runtime_overhead_bytes": RUNTIME_OVERHEAD_BYTES, "total_bytes": total,
    }, budget_bytes)


def _verdict(plan: dict, budget_bytes: int) -> dict:
    total = plan["total_bytes"]
    plan["budget_bytes"] = budget_bytes
    plan["fits"] = total <= budget_bytes
    plan["answer"] = (f"{'yes' if plan['fits'] else 'no'}: {total / GIB:.1f} GiB per GPU of {budget_bytes / GIB:.0f} GiB"
                      + (f", {(budget_bytes - total) / GIB:.1f} GiB to spare" if plan["fits"]
                         else f", {(total - budget_bytes) / GIB:.1f} GiB over"))
    return plan


# ------------------------------------------------------------------------------------------------
# Public block-diffusion families (clover/models/families.py): counts from the published tensor
# names and shapes (`FamilyConfig.param_shapes`), a bf16 memory plan
# ------------------------------------------------------------------------------------------------
def family_stats(config) -> dict:
    """Exact parameter counts of a family config (a router's expert bias is a buffer, not counted),
    routed-expert parameters scaled to the experts a token uses for the active count."""
    total = embedding = expert = 0
    for name, shape in config.param_shapes().items():
        if name.endswith("expert_bias"):
            continue
        n = _numel(shape)
        total += n
        embedding += n if ("embed" in name or name == "lm_head.weight") else 0
        expert += n if ".mlp.experts." in name else 0
    experts, per_token = config.routed_expert_count()
    inactive = expert * (experts - per_token) // experts if experts else 0
    return {
        "total_params": total, "non_embedding_params": total - embedding,
        "active_params": total - inactive, "active_non_embedding_params": total - inactive - embedding,
        "routed_expert_params": expert, "bf16_weight_bytes": 2 * total,
        "kv_bytes_per_token": config.kv_bytes_per_token(2),
        "layers": config.num_hidden_layers, "max_position_embeddings": config.max_position_embeddings,
    }


def family_memory_plan(config, block_size: int, context: int | None = None, batch: int = 1,
                       budget_bytes: int = 16 * GIB) -> dict:
    """bf16 weights, the K/V of `batch` sequences of `context` tokens, one block of logits per
    sequence and the runtime overhead; whether that fits `budget_bytes`."""
    s = family_stats(config)
    context = context or config.max_position_embeddings
    kv = s["kv_bytes_per_token"] * context * batch
    logits = block_size * config.vocab_size * 6 * batch
    total = s["bf16_weight_bytes"] + kv + logits + RUNTIME_OVERHEAD_BYTES
    return _verdict({"plan": "bf16", "context": context, "batch": batch, "weight_bytes": s["bf16_weight_bytes"],
                     "kv_cache_bytes": kv, "logits_bytes": logits, "runtime_overhead_bytes": RUNTIME_OVERHEAD_BYTES,
                     "total_bytes": total}, budget_bytes)
