"""GPTQ (Frantar et al., 2022): quantise a weight column by column, pushing each column's rounding
error onto the columns not yet quantised through the inverse Hessian of the layer's inputs, so the
layer's OUTPUT on the calibration inputs (||X W^T - X Q^T||^2) is what gets minimised, not the
weight error. Group-wise asymmetric int4 in the same stored format as round-to-nearest; the group
scale / zero point is chosen from the already-updated weights when the group's first column is
reached (the reference implementation's `groupsize` behaviour, without act-order).
"""

from __future__ import annotations

import torch

from .int4 import check_group_size, group_params, pack_int4, quantize_rtn, quantize_values


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
    """Upper Cholesky factor of H^-1 (after damping); None if H stays singular."""
    diag = torch.diagonal(h)
    damp = percdamp * diag.mean().clamp_min(1e-8)
    for attempt in range(5):
        try:
            hd = h + (damp * 10**attempt) * torch.eye(h.shape[0])
            lower = torch.linalg.cholesky(hd.double())
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True).float()
        except torch.linalg.LinAlgError:
            continue
    return None


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor | Hessian, group_size: int,
                  blocksize: int = 128, percdamp: float = 0.01) -> dict[str, torch.Tensor]:
    """W [N, K] and the Hessian of its inputs [K, K] -> the stored format (as `quantize_rtn`).
    Falls back to round-to-nearest when there were no calibration inputs."""
    check_group_size(weight.shape, group_size)
    if isinstance(hessian, Hessian):
        if hessian.n == 0:
            return quantize_rtn(weight, group_size)
        hessian = hessian.h
    n, k = weight.shape
    w = weight.float().clone()
    h = hessian.float().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0  # inputs never seen: no information, keep the weights (plain rounding)
    hinv = _inverse_cholesky(h, percdamp)
    if hinv is None:
        return quantize_rtn(weight, group_size)
    blocksize = max(group_size, blocksize // group_size * group_size)
    codes = torch.zeros(n, k)
    scales = torch.zeros(n, k // group_size)
    zeros = torch.zeros(n, k // group_size)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:  # group start: parameters from the updated weights
                s, z = group_params(w1[:, i : i + group_size])
                scales[:, col // group_size], zeros[:, col // group_size] = s, z
            s, z = scales[:, col // group_size], zeros[:, col // group_size]
            col_w = w1[:, i]
            q = quantize_values(col_w[:, None], s, z)[:, 0]
            err = (col_w - (q - z) * s) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
            codes[:, col] = q
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return {"qweight": pack_int4(codes), "scales": scales.to(torch.bfloat16), "qzeros": zeros.to(torch.uint8)}


def output_error(weight: torch.Tensor, deq: torch.Tensor, x: torch.Tensor) -> float:
    """Layer reconstruction error ||X W^T - X Q^T||_F^2 / rows on inputs x [..., K]."""
    x = x.reshape(-1, x.shape[-1]).float()
    return float(((x @ (weight.float() - deq.float()).t()) ** 2).sum() / x.shape[0])
