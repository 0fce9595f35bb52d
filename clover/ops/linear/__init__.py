"""Dense projections: `naive` is the reference (F.linear); `tiled` runs fp32 on CPU on a weight
packed once, for the few rows of a decode step (tiled.cpp). Eager forwards run torch's linear;
`graph_linear_kernel` is the choice a compiled CPU graph's linears follow."""

from __future__ import annotations

import torch

from . import tiled
from .naive import naive_linear
from .tiled import bf16_panels, tiled_experts, tiled_linear


def worth_routing(weight: torch.Tensor) -> bool:
    """A 2-D fp32 CPU weight, the op built with vector tiles (`tiled.simd()`): then every row count of
    a decode step runs at least as fast tiled (bench/linear.py); the plain C++ build would not."""
    return weight.dim() == 2 and tiled.fp32_cpu(weight) and tiled.simd() != "none"


def graph_linear_kernel(x, weight):
    """The op a compiled graph's linear of `x` (activations) and `weight` (a graph input) runs:
    `clover_cpu::linear` where `worth_routing`, None (torch's linear) otherwise. Takes example
    values (fake tensors) or None."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return None
    if x.device != weight.device or x.dtype != weight.dtype or not worth_routing(weight):
        return None
    return torch.ops.clover_cpu.linear.default


__all__ = ["bf16_panels", "graph_linear_kernel", "naive_linear", "tiled", "tiled_experts", "tiled_linear",
           "worth_routing"]
