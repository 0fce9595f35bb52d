"""The references: y = x @ W^T + b, as nn.Linear computes it; and the int4 linear on its packed layout."""

import torch
import torch.nn.functional as F


def naive_linear(x, weight, bias=None):
    return F.linear(x, weight, bias)


def naive_int4_weight(packed: torch.Tensor, sz: torch.Tensor, n: int) -> torch.Tensor:
    """W [n, K] fp32 of int4_linear.py's layout: panels uint8 [P, K/2, 16] (low nibble k even) and sz
    fp32 [P, G, 2, 16] (scale, -zero * scale): W[n, k] = q * s + (-z s)."""
    p, half, width = packed.shape
    q = torch.stack([packed & 0x0F, packed >> 4], dim=2).reshape(p, 2 * half, width).float()  # [P, K, 16]
    g = 2 * half // sz.shape[1]
    s = sz[:, :, 0].repeat_interleave(g, dim=1)  # [P, K, 16]
    zs = sz[:, :, 1].repeat_interleave(g, dim=1)
    w = q * s + zs
    return w.permute(0, 2, 1).reshape(p * width, 2 * half)[:n]


def naive_int4_linear(x, packed, sz, group_size: int, n: int):
    """What `clover_cpu::int4_linear(x, packed, sz, group_size, n)` computes, in x's dtype."""
    return F.linear(x, naive_int4_weight(packed, sz, n).to(x.dtype))
