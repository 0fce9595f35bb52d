"""Routed-expert dispatch: x [T, H] through experts chosen per token (top-k indices and weights).
Experts are stored fused: gate_up [E, 2I, H], down [E, H, I]. `naive.py` is the spec; `experts`
is the one dispatch between the fast forms."""

from __future__ import annotations

import torch

from ..linear import tiled
from .grouped import gathered_experts, grouped_experts, grouped_experts_op, segmented_experts, sort_by_expert
from .naive import naive_experts

# (token, expert) pairs up to which a compiled graph gathers the chosen experts' weights into its
# kernels (no host sync, no copy) instead of calling the opaque grouped op, whose sort, host sync and
# per-expert GEMMs cost a fixed time a layer: AR steps and forwards of up to 64 tokens at top-2
# (`python bench/moe_dispatch.py` measures the crossover)
GATHER_PAIRS = 128
# pairs from which a compiled fp32 CPU graph runs the tiled experts op (each used expert's rows
# through its packed weights, read once); an AR step's 2 pairs gather, unless the packed panels are
# bf16 (`tiled_from`)
TILED_PAIRS = 4


def tiled_from(gate_up: torch.Tensor, down: torch.Tensor) -> int:
    """The pairs from which `experts` runs the tiled op in a compiled graph for these weights: from 1
    where both are kept in bf16 panels (half the bytes: `tiled.bf16_panels`, which packs them now),
    else TILED_PAIRS. Called before tracing (it reads the weights' values)."""
    return 1 if tiled.bf16_panels(gate_up) and tiled.bf16_panels(down) else TILED_PAIRS


def experts(x, top_idx, top_w, gate_up, down, tiled_pairs: int = TILED_PAIRS) -> torch.Tensor:
    """The routed experts' output. Eagerly: `grouped_experts`. In a compiled graph, by (token, expert)
    pairs: from `tiled_pairs` on fp32 CPU tensors with the tiled op built, `clover_cpu::experts`; else
    up to GATHER_PAIRS (or the expert count) the gathered products traced into the graph; beyond, the
    grouped op as one opaque call (its routing is data-dependent)."""
    if not torch.compiler.is_compiling():
        return grouped_experts(x, top_idx, top_w, gate_up, down)
    pairs = top_idx.numel()
    if pairs >= tiled_pairs and tiled.fp32_cpu(x, gate_up) and tiled.simd() != "none":
        return tiled.tiled_experts(x, top_idx, top_w, gate_up, down)
    if pairs <= max(GATHER_PAIRS, gate_up.shape[0]):
        return gathered_experts(x, top_idx, top_w, gate_up, down)
    return grouped_experts_op(x, top_idx, top_w, gate_up, down)


__all__ = ["GATHER_PAIRS", "TILED_PAIRS", "experts", "gathered_experts", "grouped_experts", "grouped_experts_op",
           "naive_experts", "segmented_experts", "sort_by_expert", "tiled_from"]
