"""Group-wise asymmetric INT4: the portable stored format, round-to-nearest, and the matmul kernels.

Stored format (what safetensors holds, identical on every device), for a weight W [..., N, K]
quantised in groups of `g` consecutive input columns:

* `qweight` uint8 [..., N, K/2]: two 4-bit values per byte, column 2j in the low nibble, 2j+1 in
  the high nibble;
* `scales`  bf16  [..., N, K/g];
* `qzeros`  uint8 [..., N, K/g]: integer zero points in 0..15;
* dequantised weight: W[n, k] = (q[n, k] - qzeros[n, k // g]) * scales[n, k // g].

Kernels (`kernel_kind`), all computing x @ W^T:
* CPU ("clover"): `clover_cpu::int4_linear` (ops/linear/int4_linear.py) where the clover CPU kernels
  are built with vector tiles: fp32 activations, weights dequantised exactly in registers, so it
  computes F.linear on `dequantize(...)` up to summation order. Its layout (`int4_linear.pack`) is
  built at load time and never stored.
* CPU ("clover_q8", opt-in: `Int4Weight.set_kernel("int8")`, or for "auto" `CLOVER_INT4_ACTIVATIONS=int8` /
  `ops.linear.int4_q8.use_int8_activations(True)`): `clover_cpu::int4_q8_linear` (ops/linear/int4_q8.py),
  the activations rounded to int8 per block of 32 and integer dot products with the 4-bit codes (as
  llama.cpp's q4_0 x q8_0): F.linear on the rounded activations and `dequantize(...)`. Layout
  `int4_q8.pack`, built at load time and never stored.
* CPU ("cpu": elsewhere, or under `Int4Weight.set_kernel("aten")`): torch's
  `_weight_int4pack_mm_for_cpu` on bf16 activations. Its weight layout is produced by
  `_convert_weight_to_int4pack_for_cpu` (ISA-specific, so it is built at load time and never
  stored); it wants N % 16 == 0 (rows are zero-padded to that) and `scales_and_zeros` [K/g, N, 2]
  in tinygemm's form W = (q - 8) * scale + zero, i.e. zero = (8 - qzero) * scale.
* CUDA: the tinygemm op `_weight_int4pack_mm` when it accepts the shapes, else the reference.
* reference: dequantise, then F.linear (any device, any dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BITS = 4
QMAX = 2**BITS - 1
GROUP_SIZES = (32, 64, 128)
CPU_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
CPU_INNER_K_TILES = 2  # ignored by the CPU packer (layout checked equal for 1, 2, 4, 8)
CUDA_INNER_K_TILES = 8
CLOVER_KINDS = ("clover", "clover_q8")  # clover's own CPU kernels (fp32 / int8 activations)
CPU_SERIAL_WORK = 2**23  # rows * N * K below which the CPU kernel runs on one thread


# ------------------------------------------------------------------------------------------------
# Packing
# ------------------------------------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., K] values in 0..15 (any integer dtype) -> uint8 [..., K/2], low nibble first."""
    if q.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of int4 columns ({q.shape[-1]})")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] (inverse of `pack_int4`)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


# ------------------------------------------------------------------------------------------------
# Quantising
# ------------------------------------------------------------------------------------------------
def check_group_size(shape, group_size: int, name: str = "weight") -> None:
    k = shape[-1]
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k} of {name} {tuple(shape)}")


def group_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (bf16-representable, fp32) and integer zero point for each row of `w` [..., g]: the
    range [min(w, 0), max(w, 0)] is mapped onto 0..15 (zero stays exactly representable)."""
    w = w.float()
    lo = w.amin(-1).clamp(max=0)
    hi = w.amax(-1).clamp(min=0)
    scale = ((hi - lo) / QMAX).to(torch.bfloat16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, QMAX)
    return scale, zero


def quantize_values(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest codes of `w` [..., c] for per-row (broadcast) scale / zero: fp32 0..15."""
    return torch.clamp(torch.round(w.float() / scale[..., None]) + zero[..., None], 0, QMAX)


def quantize_rtn(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """W [..., N, K] -> {'qweight', 'scales', 'qzeros'} in the stored format (round to nearest)."""
    check_group_size(w.shape, group_size)
    *lead, n, k = w.shape
    groups = w.float().reshape(*lead, n, k // group_size, group_size)
    scale, zero = group_params(groups)
    q = quantize_values(groups, scale, zero).reshape(*lead, n, k)
    return {"qweight": pack_int4(q), "scales": scale.to(torch.bfloat16), "qzeros": zero.to(torch.uint8)}


def dequantize(qweight, scales, qzeros, dtype=torch.float32) -> torch.Tensor:
    """Stored format -> W [..., N, K] in `dtype` (computed in fp32)."""
    q = unpack_int4(qweight).float()
    g = q.shape[-1] // scales.shape[-1]
    w = (q.unflatten(-1, (-1, g)) - qzeros.float()[..., None]) * scales.float()[..., None]
    return w.flatten(-2).to(dtype)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
def reference_matmul(x, qweight, scales, qzeros, bias=None):
    """Dequantise, then matmul in x's dtype: the definition the fast kernels are tested against."""
    return F.linear(x, dequantize(qweight, scales, qzeros, x.dtype), bias)


def tinygemm_scales_and_zeros(scales, qzeros, rows: int | None = None) -> torch.Tensor:
    """[N, K/g] scale / zero point -> tinygemm's [K/g, rows, 2] bf16 (zero-padded to `rows`)."""
    s = scales.float()
    z = (8 - qzeros.float()) * s
    sz = torch.stack([s, z], dim=-1).transpose(0, 1)  # [K/g, N, 2]
    if rows is not None and rows > sz.shape[1]:
        sz = F.pad(sz, (0, 0, 0, rows - sz.shape[1]))
    return sz.to(torch.bfloat16).contiguous()


def stored_from_tinygemm(sz: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `tinygemm_scales_and_zeros` (exact: |8 - qzero| <= 8 keeps the error < 0.5)."""
    sz = sz[:, :n].transpose(0, 1).float()
    scales = sz[..., 0]
    qzeros = torch.round(8 - sz[..., 1] / scales).clamp(0, QMAX)
    return scales.to(torch.bfloat16), qzeros.to(torch.uint8)


def cpu_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


class PackedInt4:
    """One weight matrix [N, K] in a device kernel's layout (built from the stored format)."""

    __slots__ = ("kind", "weight", "sz", "n", "k", "group_size")

    def __init__(self, kind, weight, sz, n, k, group_size):
        self.kind, self.weight, self.sz, self.n, self.k, self.group_size = kind, weight, sz, n, k, group_size

    @classmethod
    def build(cls, qweight, scales, qzeros, kind: str) -> "PackedInt4":
        n, k = qweight.shape[0], qweight.shape[1] * 2
        g = k // scales.shape[-1]
        if kind in CLOVER_KINDS:
            return cls(kind, *clover_layout(kind).pack(qweight, scales, qzeros), n, k, g)
        if kind == "cpu":
            rows = -(-n // CPU_N_MULTIPLE) * CPU_N_MULTIPLE
            q = unpack_int4(qweight).to(torch.int32)
            if rows > n:
                q = F.pad(q, (0, 0, 0, rows - n), value=8)
            weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), CPU_INNER_K_TILES)
            return cls("cpu", weight, tinygemm_scales_and_zeros(scales, qzeros, rows), n, k, g)
        if kind == "cuda":
            # tinygemm packs uint8 [N, K/2] with the even column in the HIGH nibble.
            q = unpack_int4(qweight)
            hi_first = (q[:, 0::2] << 4) | q[:, 1::2]
            weight = torch.ops.aten._convert_weight_to_int4pack(hi_first.contiguous(), CUDA_INNER_K_TILES)
            return cls("cuda", weight, tinygemm_scales_and_zeros(scales, qzeros), n, k, g)
        raise ValueError(f"no int4 kernel of kind {kind!r}")

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (any float dtype) -> [..., N] in x's dtype, computed in fp32 ("clover") or with
        bf16 activations (torch's kernels)."""
        if self.kind in CLOVER_KINDS:
            return packed_matmul(x, self.weight, self.sz, self.group_size, self.n, self.kind)
        threads = torch.get_num_threads()
        if self.kind == "cpu" and threads > 1 and x.numel() * self.n < CPU_SERIAL_WORK:
            # small products: the kernel's parallel_for costs more than it saves, and on a core
            # busy with other work waits far longer for its worker than the product takes
            torch.set_num_threads(1)
            try:
                return packed_matmul(x, self.weight, self.sz, self.group_size, self.n, self.kind)
            finally:
                torch.set_num_threads(threads)
        return packed_matmul(x, self.weight, self.sz, self.group_size, self.n, self.kind)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Recover the stored format exactly (for saving after the stored copy was released): the
        kernel itself multiplies an identity by the weight with scale 1 and zero 8, giving q."""
        if self.kind in CLOVER_KINDS:
            return clover_layout(self.kind).unpack(self.weight, self.sz, self.n)
        if self.kind != "cpu":
            raise RuntimeError("only the CPU layout releases the stored copy")
        groups = self.sz.shape[0]
        unit = torch.stack([torch.ones(groups, self.sz.shape[1]), torch.full((groups, self.sz.shape[1]), 8.0)], -1)
        eye = torch.eye(self.k, dtype=torch.bfloat16)
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight, self.group_size, unit.to(torch.bfloat16))
        q = q[:, : self.n].t().round().to(torch.uint8)
        scales, qzeros = stored_from_tinygemm(self.sz, self.n)
        return pack_int4(q), scales, qzeros


def clover_layout(kind: str):
    """The module of a clover CPU kernel's layout (`pack`, `unpack`): ops/linear/int4_linear.py for
    "clover", int4_q8.py for "clover_q8"."""
    from ..ops.linear import int4_linear, int4_q8

    return int4_linear if kind == "clover" else int4_q8


def packed_matmul(x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor, group_size: int, n: int,
                  kind: str = "cpu") -> torch.Tensor:
    """x [..., K] @ W^T -> [..., n] in x's dtype for W in a kernel's layout (`PackedInt4`), with fp32
    ("clover"), int8 ("clover_q8") or bf16 activations; traceable (a compiled graph calls it on the layout
    held as buffers)."""
    if kind == "clover":
        return torch.ops.clover_cpu.int4_linear(x, weight, sz, group_size, n)
    if kind == "clover_q8":
        return torch.ops.clover_cpu.int4_q8_linear(x, weight, sz, group_size, n)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.dtype != torch.bfloat16:
        x2 = x2.to(torch.bfloat16)
    if kind == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), weight, group_size, sz)
    else:
        y = torch.ops.aten._weight_int4pack_mm(x2.contiguous(), weight, group_size, sz)
    if y.shape[-1] != n:
        y = y[:, :n]
    return y.reshape(*shape[:-1], n).to(x.dtype)


def clover_kernel_available() -> bool:
    """`clover_cpu::int4_linear` built with vector tiles for this CPU (builds the kernels if needed)."""
    from ..ops.linear import int4_linear

    return int4_linear.available()


def kernel_kind(device: torch.device, prefer_aten: bool = False, int8: bool | None = None) -> str:
    """The kernel an int4 matmul uses on this device: 'clover_q8' (int8 activations: where `int8`, or
    None and `int4_q8.int8_activations()`), 'clover', 'cpu' (torch's CPU kernel; also where
    `prefer_aten`), 'cuda' or 'reference'."""
    if device.type == "cpu" and not prefer_aten and clover_kernel_available():
        from ..ops.linear import int4_q8

        return "clover_q8" if (int4_q8.int8_activations() if int8 is None else int8) and int4_q8.available() else "clover"
    if device.type == "cpu" and cpu_kernel_available():
        return "cpu"
    if device.type == "cuda" and hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        return "cuda"
    return "reference"
