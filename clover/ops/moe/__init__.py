"""Routed-expert dispatch: x [T, H] through experts chosen per token (top-k indices and weights).
Experts are stored fused: gate_up [E, 2I, H], down [E, H, I]."""

from .grouped import gathered_experts, grouped_experts, grouped_experts_op, segmented_experts, sort_by_expert
from .naive import naive_experts

__all__ = ["gathered_experts", "grouped_experts", "grouped_experts_op", "naive_experts", "segmented_experts", "sort_by_expert"]
