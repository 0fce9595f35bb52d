"""Greedy pick: for each row of logits [..., V], the greedy token among the ids not banned (the
first maximum) and its softmax probability over those ids, without forming the distribution.
Greedy diffusion steps whose fill policy scores by probability (low_confidence, topk) and greedy
AR / self-spec steps need nothing else. `naive.py` is the spec; on fp32 CPU logits the C++ kernel
(`greedy_pick.cpp`, three vectorised passes over each row) runs, elsewhere (CUDA, bf16, no
compiler) torch's max and a sum of exponentials."""

from __future__ import annotations

import torch

from ..linear import tiled
from .naive import naive_greedy_pick


def greedy_pick(logits: torch.Tensor, banned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V], banned: int64 ids on logits' device (never chosen) -> (tokens [...] int64,
    their probabilities [...] fp32). Ties go to the lowest id, as torch.argmax; rows with NaN
    logits give a NaN probability."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and tiled.available():
        return torch.ops.clover_cpu.greedy_pick(logits, banned)
    return torch_greedy_pick(logits, banned)


def torch_greedy_pick(logits: torch.Tensor, banned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with torch ops (any device and dtype): max over the allowed ids (torch.max returns
    the first maximal index), then 1 / sum exp(l - max)."""
    masked = logits.to(torch.float32, copy=True).index_fill_(-1, banned, float("-inf"))
    top, tokens = masked.max(-1)
    return tokens, (masked - top[..., None]).exp_().sum(-1).reciprocal_()


__all__ = ["greedy_pick", "naive_greedy_pick", "torch_greedy_pick"]
