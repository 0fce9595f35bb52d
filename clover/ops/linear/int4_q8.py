"""int4 weights x int8 activations on CPU (`clover_cpu::int4_q8_linear`, int4_q8.cpp): the activations
quantised per row and block of 32 columns to int8 with an fp32 scale (as llama.cpp's q8_0 does for
its q4_0 matmuls), integer dot products of 4-bit codes with them (AVX-512 VNNI / AVX-VNNI vpdpbusd,
else AVX2 maddubs + madd), scaled per block and group in fp32.

Why: int4.cpp dequantises every weight to fp32 and FMAs it with fp32 activations (several vector
instructions per weight: about as fast as fp32); here one instruction takes 64 weights.

What it computes: with d = max|x_block| / 127 and a = round(x / d) (nearest even, clamped to +-127),
y = F.linear(d * a, dequantize(weight)) up to fp32 rounding: the zero-point term takes the sums of
the quantised activations, so the activations are simply rounded and the weight is exact
(`naive.naive_int4_q8_linear`; tests: within K + 1 fp32 roundings of the summed |products| of an fp64
reference). The activations' rounding (at most d / 2 per value, 2^-8 of the block's largest) moves
an output by at most sum |W| * d / 2; on random inputs the result is within 1% (relative, largest
output) of the fp32-activation kernel's (tests/test_int4_q8.py).

Opt-in, process-wide (`use_int8_activations(True)`, `CLOVER_INT4_ACTIVATIONS=int8`): an int4 layer
built while it is on packs this layout (`pack`; in memory only, never stored) and runs every product
through it, eager or traced; its tokens can differ from the fp32-activation kernel's. Layout:

* `packed` uint8 [ceil(N/16), K/8, 16, 4]: byte [p, c, j, t] = q[16p+j, 8c+t] | q[16p+j, 8c+4+t] << 4;
* `sz` fp32 [ceil(N/16), K/g, 2, 16]: (scale, -zero * scale), as int4_linear.py's (0 past N).
"""

from __future__ import annotations

import os

import torch

from . import int4_linear

PANEL = 16
BLOCK = 32  # activation columns per int8 scale
ACTIVATIONS = ("float32", "int8")  # CLOVER_INT4_ACTIVATIONS
_state: dict = {"int8": os.environ.get("CLOVER_INT4_ACTIVATIONS", "float32") == "int8"}


def available() -> bool:
    """Whether the kernel is built with vector tiles for this CPU (its fakes: tiled.py's)."""
    return int4_linear.available()


def use_int8_activations(on: bool) -> bool:
    """Let int4 layers built from now on take int8 activations (this kernel); returns the previous
    setting. A layer already packed keeps its kernel until it is rebuilt (`set_int4_kernel`)."""
    was, _state["int8"] = _state["int8"], bool(on)
    return was


def int8_activations() -> bool:
    """Whether int8 activations are asked for (they run where `available()`)."""
    return _state["int8"]


def pack(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored format (qweight uint8 [N, K/2], scales bf16 [N, G], qzeros uint8 [N, G]) -> (packed, sz)."""
    panels, sz = int4_linear.pack(qweight, scales, qzeros)
    p, half, _ = panels.shape
    codes = torch.stack([panels & 0x0F, panels >> 4], dim=2).reshape(p, half // 4, 2, 4, PANEL)  # [P, c, lo/hi, t, j]
    codes = codes.permute(0, 1, 4, 3, 2)  # [P, c, j, t, lo/hi]
    return (codes[..., 0] | (codes[..., 1] << 4)).contiguous(), sz


def unpack(packed: torch.Tensor, sz: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed, sz) -> the stored format (qweight, scales, qzeros), as `int4_linear.unpack`."""
    p, chunks = packed.shape[:2]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).permute(0, 1, 4, 3, 2)  # [P, c, lo/hi, t, j]
    codes = codes.reshape(p, 8 * chunks, PANEL)
    panels = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return int4_linear.unpack(panels.contiguous(), sz, n)


def int4_q8_linear(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int, n: int) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., n] in x's dtype (int8 activations, fp32 scales and sums) through
    `clover_cpu::int4_q8_linear`; traceable (an opaque op with a fake)."""
    if not available():
        raise RuntimeError("the clover int4 x int8 linear is not available on this machine")
    return torch.ops.clover_cpu.int4_q8_linear(x, packed, sz, group_size, n)


def int4_q8_experts(x, top_idx, top_w, gate_up, gate_up_sz, down, down_sz, group_size: int, inter: int) -> torch.Tensor:
    """`int4_linear.int4_experts` on this layout (each projection's input rows quantised to int8)."""
    if not available():
        raise RuntimeError("the clover int4 x int8 linear is not available on this machine")
    return torch.ops.clover_cpu.int4_q8_experts(x, top_idx, top_w, gate_up, gate_up_sz, down, down_sz, group_size, inter)
