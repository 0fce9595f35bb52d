"""Attention inside equal windows anchored at the end: the GDN layers' intra-block bidirectional branch
when every window of a forward has one size (a block-diffusion prompt, a window with the block it
commits). Same result as `masked_attention` with the same-window mask (naive_masked_attention is the
spec), at (window / length) of its work: each window's scores are a window x window product instead of
a row of the whole length's, which a masked dense kernel computes and throws away (a 64-column prompt
in windows of 4: 1/16 of the products)."""

import torch
import torch.nn.functional as F

SUMMED_WINDOW = 8  # compiled: windows up to this size run as fused product-sums, wider ones as matmuls


def local_window_attention(q, k, v, valid, window: int):
    """q, k [B, L, H, D], v [B, L, H, Dv] (one head layout for all three); valid [B, L] bool or None:
    which columns may be attended to (a padded column attends to itself only, as in the stream
    layout's mask). Windows of `window` columns anchored at the end, the first one partial. Returns
    [B, L, H, Dv] in fp32."""
    batch, length, heads, _ = q.shape
    extra = (-length) % window
    n = (length + extra) // window
    if valid is None:
        valid = torch.ones(batch, length, dtype=torch.bool, device=q.device)
    valid = F.pad(valid, (extra, 0), value=False).view(batch, n, 1, window)  # alignment columns: never keys

    def blocks(x):  # [B, L, H, D] -> [B, N, W, H, D]
        return F.pad(x.float(), (0, 0, 0, 0, extra, 0)).view(batch, n, window, heads, -1)

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    eye = torch.eye(window, dtype=torch.bool, device=q.device)
    allowed = valid | (eye & ~valid.transpose(-1, -2))  # [B, N, W(q), W(k)]: a padded query sees itself
    if torch.compiler.is_compiling() and window <= SUMMED_WINDOW:
        # products summed: a compiled graph fuses them into one loop nest, where a bmm on [B*H*N, W, D]
        # costs more than its arithmetic
        scores = (qb[:, :, :, None] * kb[:, :, None]).sum(-1)  # [B, N, W(q), W(k), H]
        weights = torch.softmax(scores.masked_fill(~allowed[..., None], float("-inf")), dim=3)
        out = (weights[..., None] * vb[:, :, None]).sum(3)  # [B, N, W(q), H, Dv]
    else:  # matmuls: eagerly, a product-sum would materialise [B, N, W, W, H, D]
        scores = torch.einsum("bnihd,bnjhd->bnhij", qb, kb)
        weights = torch.softmax(scores.masked_fill(~allowed[:, :, None], float("-inf")), dim=-1)
        out = torch.einsum("bnhij,bnjhd->bnihd", weights, vb)
    return out.reshape(batch, n * window, heads, -1)[:, extra:]
