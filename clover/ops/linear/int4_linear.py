"""int4 linear for the few rows of a decode step on CPU (`clover_cpu::int4_linear`, int4.cpp), fp32
activations, on quant/int4.py's stored format repacked once into panels of 16 output columns.

Why: torch's `_weight_int4pack_mm_for_cpu` takes bf16 activations (a conversion each way per call)
and pays per-call costs that dominate a decode step's small products. This kernel reads 4-bit codes,
dequantises each k's 16 weights in vector registers as fma(q, s, -z s) (exact: the reference's
dequantised weight bit for bit) and FMAs them with fp32 activations, one chain per output in k order:
the numbers of F.linear on `dequantize(...)` up to summation order (tests: within a few fp32 roundings
of the summed |products| of an fp64 reference), and a row's result does not depend on the rows it
shares a call with. Layout (`pack`; in memory only, never stored):

* `packed` uint8 [ceil(N/16), K/2, 16]: byte [p, i, j] = q[16p+j, 2i] | q[16p+j, 2i+1] << 4;
* `sz` fp32 [ceil(N/16), K/g, 2, 16]: (scale, -zero * scale) per group and column; 0 past N.

The reference for the layout is `naive.naive_int4_linear`; `unpack` returns the stored format exactly.
"""

from __future__ import annotations

import torch

from . import tiled

PANEL = 16


def available() -> bool:
    """Whether the kernel is built with vector tiles for this CPU (the plain C++ build is for tests:
    slower than torch's int4 kernel, never routed to)."""
    return tiled.simd() != "none"


def pack(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored format (qweight uint8 [N, K/2], scales bf16 [N, G], qzeros uint8 [N, G]) -> (packed, sz)."""
    n, half = qweight.shape
    panels = -(-n // PANEL)
    pad = panels * PANEL - n
    q = torch.nn.functional.pad(qweight, (0, 0, 0, pad))  # code 0 past N (scale 0 there)
    packed = q.reshape(panels, PANEL, half).transpose(1, 2).contiguous()
    s = scales.float()
    sz = torch.stack([s, -qzeros.float() * s], dim=-1)  # [N, G, 2]
    sz = torch.nn.functional.pad(sz, (0, 0, 0, 0, 0, pad))
    return packed, sz.reshape(panels, PANEL, -1, 2).permute(0, 2, 3, 1).contiguous()


def unpack(packed: torch.Tensor, sz: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed, sz) -> the stored format (qweight, scales, qzeros), exactly where every scale is nonzero
    (quant/int4.py's quantiser makes none zero); a zero scale's zero point comes back as 0."""
    qweight = packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n].contiguous()
    sz = sz.permute(0, 3, 1, 2).reshape(-1, sz.shape[1], 2)[:n]
    s = sz[..., 0]
    zero = torch.where(s != 0, -sz[..., 1] / torch.where(s != 0, s, 1), 0).round()
    return qweight, s.to(torch.bfloat16), zero.to(torch.uint8)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int, n: int) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., n] in x's dtype (computed in fp32) through `clover_cpu::int4_linear`;
    traceable (an opaque op with a fake)."""
    if not tiled.available():
        raise RuntimeError("the clover int4 linear is not available on this machine")
    return torch.ops.clover_cpu.int4_linear(x, packed, sz, group_size, n)


def int4_experts(x, top_idx, top_w, gate_up, gate_up_sz, down, down_sz, group_size: int, inter: int) -> torch.Tensor:
    """ops/moe/naive.py's routed SwiGLU experts on int4 stacks in this layout (gate_up [E, P, H/2, 16]
    with sz [E, P, H/g, 2, 16], down likewise over I) through `clover_cpu::int4_experts`: one opaque op
    with a static output shape, so a compiled graph calls it for any routing."""
    if not tiled.available():
        raise RuntimeError("the clover int4 linear is not available on this machine")
    return torch.ops.clover_cpu.int4_experts(x, top_idx, top_w, gate_up, gate_up_sz, down, down_sz, group_size, inter)
