"""Masked attention through torch's scaled_dot_product_attention (fused kernels on CPU and CUDA), or,
in compiled CPU graphs, a decode step's single query row through `clover_cpu::decode_attention`
(decode.cpp: only the keys the mask allows, the query heads of a K/V head together)."""

import torch
import torch.nn.functional as F

from ..linear import tiled


def masked_attention(q, k, v, mask, scale):
    """Same contract as naive_masked_attention; every query row must allow at least one key."""
    if decode_kernel(q, k, v, mask):
        return torch.ops.clover_cpu.decode_attention(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def decode_kernel(q, k, v, mask) -> bool:
    """Whether `decode_attention` runs this call: inside a compiled graph, one query row, fp32 CPU
    tensors, a bool mask, K/V with a unit last stride, the op built. Eager forwards keep torch's SDPA."""
    if q.shape[2] != 1 or not torch.compiler.is_compiling() or mask is None or mask.dtype != torch.bool:
        return False
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.shape[1] % k.shape[1]:
        return False
    return tiled.fp32_cpu(q, k, v) and tiled.available()
