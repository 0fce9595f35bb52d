"""Dense projections: `naive` is the reference (F.linear); `tiled` runs fp32 on CPU on a weight
packed once, for the few rows of a decode step (tiled.cpp)."""

from .naive import naive_linear
from .tiled import bf16_panels, experts_fit, solve_fits, tiled_experts, tiled_linear, worth_routing

__all__ = ["bf16_panels", "experts_fit", "naive_linear", "solve_fits", "tiled_experts", "tiled_linear", "worth_routing"]
