"""GPTQ (Frantar et al., 2022): quantise a weight column by column, pushing each column's rounding
error onto the columns not yet quantised through the inverse Hessian of the layer's inputs, so the
layer's OUTPUT on the calibration inputs (||X W^T - X Q^T||^2) is what gets minimised, not the
weight error. Group-wise asymmetric int4 in the same stored format as round-to-nearest; the group
scale / zero point is chosen from the already-updated weights when the group's first column is
reached (the reference implementation's `groupsize` behaviour, without act-order).
"""

from __future__ import annotations

import torch

from .int4 import QMAX, check_group_size, group_params, pack_int4, quantize_rtn


class Hessian:
    """Running H = 2/n * sum x x^T over the rows of the inputs seen (fp32)."""

    def __init__(self, k: int):
        self.h = torch.zeros(k, k)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        m = x.shape[0]
        if m == 0:
            return
        self.h.mul_(self.n / (self.n + m))
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.h.addmm_(x.t(), x)


def _inverse_cholesky(h: torch.Tensor, percdamp: float) -> torch.Tensor | None:
    """Upper Cholesky factors of H^-1 [..., K, K] (after damping); None if H stays singular."""
    damp = percdamp * torch.diagonal(h, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-8)
    eye = torch.eye(h.shape[-1], dtype=torch.float64)
    for attempt in range(5):
        hd = h.double() + (damp.double() * 10**attempt)[..., None, None] * eye
        lower, info = torch.linalg.cholesky_ex(hd)
        if not info.any():
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True).float()
    return None


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian, group_size: int, blocksize: int = 128,
                  percdamp: float = 0.01) -> dict[str, torch.Tensor]:
    """W [..., N, K] and the Hessians of its inputs ([..., K, K], or Hessian objects: one, or a list
    for a stack) -> the stored format (as `quantize_rtn`). A stack (e.g. the experts of a layer) runs
    as one batched pass. A matrix that saw no calibration inputs gets an identity Hessian, which
    makes GPTQ plain round-to-nearest."""
    check_group_size(weight.shape, group_size)
    k = weight.shape[-1]
    if isinstance(hessian, Hessian):
        hessian = [hessian]
    if isinstance(hessian, (list, tuple)):
        hessian = torch.stack([h.h if h.n else torch.eye(k) for h in hessian])
    lead = weight.shape[:-2]
    w = weight.float().reshape(-1, *weight.shape[-2:]).clone()  # [B, N, K]
    h = hessian.float().reshape(-1, k, k).clone()
    b, n, _ = w.shape
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    diag[diag == 0] = 1.0  # inputs never seen: no information, plain rounding for those columns
    hinv = _inverse_cholesky(h, percdamp)
    if hinv is None:
        return quantize_rtn(weight, group_size)
    blocksize = max(group_size, blocksize // group_size * group_size)
    codes = torch.zeros(b, n, k)
    scales = torch.zeros(b, n, k // group_size)
    zeros = torch.zeros(b, n, k // group_size)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        w1 = w[:, :, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            grp = col // group_size
            if col % group_size == 0:  # group start: parameters from the updated weights
                scales[..., grp], zeros[..., grp] = group_params(w1[:, :, i : i + group_size])
            s, z = scales[..., grp], zeros[..., grp]
            col_w = w1[:, :, i]
            q = torch.clamp(torch.round(col_w / s) + z, 0, QMAX)
            err = (col_w - (q - z) * s) / hinv1[:, i, i, None]
            w1[:, :, i:] -= err[:, :, None] * hinv1[:, None, i, i:]
            err1[:, :, i] = err
            codes[:, :, col] = q
        w[:, :, i2:] -= err1 @ hinv[:, i1:i2, i2:]
    shape = (*lead, n)
    return {"qweight": pack_int4(codes).reshape(*shape, k // 2), "scales": scales.to(torch.bfloat16).reshape(*shape, -1),
            "qzeros": zeros.to(torch.uint8).reshape(*shape, -1)}


def output_error(weight: torch.Tensor, deq: torch.Tensor, x: torch.Tensor) -> float:
    """Layer reconstruction error ||X W^T - X Q^T||_F^2 / rows on inputs x [..., K]."""
    x = x.reshape(-1, x.shape[-1]).float()
    return float(((x @ (weight.float() - deq.float()).t()) ** 2).sum() / x.shape[0])
