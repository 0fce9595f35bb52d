"""Which slice of each parameter a rank holds under --tp / --ep: pure arithmetic on the config (no
torch), shared by the parallel loader (parallel.py) and the memory plan (clover/sizes.py)."""

from __future__ import annotations


def check_parallel(config, tp: int, ep: int) -> None:
    """ValueError unless the model splits this way."""
    if tp < 1 or ep < 1:
        raise ValueError(f"--tp and --ep must be >= 1, got {tp} and {ep}")
    if tp > 1 and ep > 1:
        raise ValueError("give --tp or --ep, not both (a 2-D mesh is not supported)")
    if getattr(config, "quantization_config", None):
        raise ValueError("tensor / expert parallel runs need a bf16/fp32 checkpoint, not an int4 one")
    need = {}
    if tp > 1:
        need = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
                "linear_num_key_heads": config.linear_num_key_heads,
                "linear_num_value_heads": config.linear_num_value_heads,
                "moe_intermediate_size": config.moe_intermediate_size,
                "shared_expert_intermediate_size": config.shared_expert_intermediate_size}
    if ep > 1:
        need = {"num_experts": config.num_experts,
                "shared_expert_intermediate_size": config.shared_expert_intermediate_size}
    n = max(tp, ep)
    for name, value in need.items():
        if value % n:
            raise ValueError(f"{'--tp' if tp > 1 else '--ep'} {n} must divide {name} = {value}")


def _split(sizes: list[int], rank: int, n: int) -> list[tuple[int, int]]:
    """This rank's [start, end) in each of the consecutive segments `sizes` of one dimension."""
    out, base = [], 0
    for s in sizes:
        part = s // n
        out.append((base + rank * part, base + (rank + 1) * part))
        base += s
    return out


def shard_plan(config, tp: int, ep: int, rank: int) -> dict[str, tuple[int, list[tuple[int, int]]] | str]:
    """{parameter name: (dim, [(start, end), ...])} for the sharded parameters of rank `rank`;
    "zero_unless_rank0" for a row-parallel bias. Parameters not named are replicated."""
    c = config
    plan: dict = {}
    n = max(tp, ep)
    if n == 1:
        return plan
    D, H, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    Kd, Vd, Hv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim, \
        c.linear_num_value_heads
    I, si, E = c.moe_intermediate_size, c.shared_expert_intermediate_size, c.num_experts
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        if tp > 1 and kind == "full_attention":
            rows = _split([H * D, H * D, Hkv * D, Hkv * D], rank, tp)
            plan[p + "self_attn.qkv_proj.weight"] = (0, rows)
            if c.attention_bias:
                plan[p + "self_attn.qkv_proj.bias"] = (0, rows)
                plan[p + "self_attn.o_proj.bias"] = "zero_unless_rank0"
            plan[p + "self_attn.o_proj.weight"] = (1, _split([H * D], rank, tp))
        elif tp > 1:
            g = p + "linear_attn."
            plan[g + "in_proj.weight"] = (0, _split([Kd, Kd, Vd, Vd, Hv, Hv], rank, tp))
            conv = _split([Kd, Kd, Vd], rank, tp)
            plan[g + "conv1d.weight"] = (0, conv)
            plan[g + "right_conv"] = (0, conv)
            for name in ("dt_bias", "A_log", "bidir_log_scale"):
                plan[g + name] = (0, _split([Hv], rank, tp))
            plan[g + "block_calibration"] = (1, _split([Hv], rank, tp))
            plan[g + "out_proj.weight"] = (1, _split([Vd], rank, tp))
        m = p + "mlp."
        if tp > 1:
            plan[m + "experts.gate_up_proj"] = (1, _split([I, I], rank, tp))
            plan[m + "experts.down_proj"] = (2, _split([I], rank, tp))
        else:
            plan[m + "experts.gate_up_proj"] = (0, _split([E], rank, ep))
            plan[m + "experts.down_proj"] = (0, _split([E], rank, ep))
        if si:
            plan[m + "shared_expert.gate_up_proj.weight"] = (0, _split([si, si], rank, n))
            plan[m + "shared_expert.down_proj.weight"] = (1, _split([si], rank, n))
    return plan


def local_shape(shape, entry) -> tuple[int, ...]:
    if entry is None or isinstance(entry, str):
        return tuple(shape)
    dim, segs = entry
    out = list(shape)
    out[dim] = sum(b - a for a, b in segs)
    return tuple(out)
