"""The specification of a greedy pick: the softmax over the allowed ids (the banned ones at -inf),
its argmax (the first maximum) and that token's probability."""

from __future__ import annotations

import torch


def naive_greedy_pick(logits: torch.Tensor, banned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V], banned int64 ids -> (tokens [...] int64, their probabilities [...] fp32)."""
    masked = logits.to(torch.float32, copy=True)
    masked[..., banned] = float("-inf")
    probs = torch.softmax(masked, dim=-1)
    tokens = probs.argmax(-1)
    return tokens, probs.gather(-1, tokens[..., None]).squeeze(-1)
