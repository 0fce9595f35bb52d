"""Gated delta rule: S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T, o_t = scale * S_t^T q_t,
with a_t = exp(g_t). Shapes: q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; state [B, H, Dk, Dv]
in fp32. q and k arrive L2-normalised and already expanded to the value heads."""

import torch

from ..linear import tiled
from .chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_from_states
from .fused_recurrent import fused_recurrent_gated_delta_rule
from .naive import naive_gated_delta_rule


def gated_delta_rule(q, k, v, g, beta, scale, initial_state=None, output_final_state: bool = True):
    """Causal gated delta rule over the whole sequence; picks the faster form for the length. Without
    `output_final_state` (a draft window, whose state is never kept) the state returned is None, and
    a window of 3-64 tokens is one chunk read from the initial state, skipping the state update."""
    length = q.shape[1]
    if length <= 2:
        out, state = fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state)
    elif not output_final_state and length <= 64 and initial_state is not None:
        return chunk_gated_delta_rule_from_states(q, k, v, g, beta, scale, initial_state[:, :, None], length), None
    else:
        out, state, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, chunk_size=min(64, length))
    return out, state if output_final_state else None


def step_into(q, k, v, g, beta, scale, state):
    """One decode step written into `state` in place, returning the output [B, 1, H, Dv], where
    `clover_cpu::recurrent_step_` (recurrent_step.cpp; spec: `fused_recurrent_gated_delta_rule`)
    runs it: inside compiled CPU graphs on fp32 tensors with a contiguous state, the op built. None
    elsewhere (the caller takes `gated_delta_rule` and writes the state itself), so eager decoding
    keeps torch's ops."""
    if q.shape[1] != 1 or not torch.compiler.is_compiling() or not state.is_contiguous():
        return None
    if not (tiled.fp32_cpu(q, k, v, g, beta, state) and tiled.available()):
        return None
    return torch.ops.clover_cpu.recurrent_step_(q, k, v, g, beta, scale, state)


def graph_solve_kernel(system, rhs, upper=None, unitriangular=None, left=True, **other):
    """The op a compiled graph's `torch.linalg.solve_triangular(system, rhs, **kwargs)` runs: the
    chunk systems' unit lower-triangular solves on fp32 CPU tensors go to `clover_cpu::unit_lower_solve`
    (row-by-row forward substitution, unit_lower_solve.cpp) where the op is built; None (torch's
    solve) otherwise. Takes example values (fake tensors) or None."""
    if other or upper is not False or unitriangular is not True or left is not True:
        return None
    if not (isinstance(system, torch.Tensor) and isinstance(rhs, torch.Tensor)):
        return None
    if not (tiled.fp32_cpu(system, rhs) and tiled.available()):
        return None
    return torch.ops.clover_cpu.unit_lower_solve.default


__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_from_states",
    "fused_recurrent_gated_delta_rule",
    "gated_delta_rule",
    "graph_solve_kernel",
    "step_into",
    "naive_gated_delta_rule",
]
