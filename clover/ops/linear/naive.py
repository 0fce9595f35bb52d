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


def naive_q8_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] fp32 -> (a int8 [..., K], d fp32 [..., K/block]): per block d = max|x| / 127 and
    a = round(x * (1 / d)) (nearest even, clamped to +-127; 0 where d = 0), as int4_q8.cpp's `quantise`."""
    xb = x.float().unflatten(-1, (-1, block))
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    a = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return a.flatten(-2).to(torch.int8), d


def naive_q8_rounded(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The activations the int4 x int8 kernel multiplies: d * a of `naive_q8_activations`, exact in fp64."""
    a, d = naive_q8_activations(x, block)
    return (a.double().unflatten(-1, (-1, block)) * d.double()[..., None]).flatten(-2)


def naive_int4_q8_weight(packed: torch.Tensor, sz: torch.Tensor, n: int) -> torch.Tensor:
    """W [n, K] fp32 of int4_q8.py's layout: uint8 [P, K/8, 16, 4], byte [p, c, j, t] holding codes
    k = 8c + t (low nibble) and 8c + 4 + t (high) of column 16p + j; sz as `naive_int4_weight`'s."""
    p, chunks, width, _ = packed.shape
    q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).permute(0, 1, 4, 3, 2).reshape(p, 8 * chunks, width).float()
    g = 8 * chunks // sz.shape[1]
    w = q * sz[:, :, 0].repeat_interleave(g, dim=1) + sz[:, :, 1].repeat_interleave(g, dim=1)  # [P, K, 16]
    return w.permute(0, 2, 1).reshape(p * width, 8 * chunks)[:n]


def naive_int4_q8_linear(x, packed, sz, group_size: int, n: int):
    """What `clover_cpu::int4_q8_linear(x, packed, sz, group_size, n)` computes, in x's dtype:
    F.linear(d * a, W) (the int8 activations dequantised, the dequantised weight), in fp64."""
    return F.linear(naive_q8_rounded(x), naive_int4_q8_weight(packed, sz, n).double()).to(x.dtype)
