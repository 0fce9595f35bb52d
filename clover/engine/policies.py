"""Fill policies for block diffusion: which masked positions of the current block to fill this step.

A policy = a confidence score per position (from the distribution the token was drawn from) + a
selection rule. All work on whole batches [rows, block] on-device, with no host round trip.

* `low_confidence` (docs/architecture.md): fill every masked position whose probability is strictly above
  the threshold; if none is, fill the single most confident one (leftmost on ties). Positions after a
  row's first masked end token are dropped once it is filled, so a step that fills only them also
  fills the most confident position up to and including that end (`select_threshold`).
* `topk`, `entropy`, `margin` (the Dream / llama.cpp variants): a fixed budget of `steps` per block;
  each step fills ceil(masked / steps left) positions, ranked by probability, negative entropy or
  top1-top2 margin (leftmost on ties).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..settings import DEFAULTS, check_threshold, policy_steps

NEG_INF = float("-inf")


# ---- confidence scores: higher = more certain ---------------------------------------------------
def probability(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return probs.gather(-1, tokens[..., None]).squeeze(-1)


def neg_entropy(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return (probs * probs.clamp_min(1e-30).log()).sum(-1)


def margin(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    top2 = probs.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


# ---- selection rules ----------------------------------------------------------------------------
def select_threshold(score: torch.Tensor, masked: torch.Tensor, threshold: float,
                     ends: torch.Tensor | None = None) -> torch.Tensor:
    """Masked positions with score > threshold; rows where none passes get their best one.
    `ends` [R, B]: the positions whose token is an end token. A row's first masked end is where the
    step predicts its answer to stop, and what follows it is dropped once that end is filled: those
    positions are still filled when they pass, but a step that fills only them fills nothing kept,
    so the row's best position up to and including that end is filled with them."""
    score = score.masked_fill(~masked, NEG_INF)
    chosen = masked & (score > threshold)
    pool = masked
    if ends is not None:
        first_end = (masked & ends).long()
        pool = masked & ((first_end.cumsum(1) - first_end) == 0)  # up to and including the first masked end
    best = torch.zeros_like(masked).scatter_(1, score.masked_fill(~pool, NEG_INF).argmax(1, keepdim=True), True)
    return chosen | (best & pool & ~(chosen & pool).any(1, keepdim=True))  # argmax: the first max = leftmost


def select_count(score: torch.Tensor, masked: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The `count[row]` highest-scoring masked positions of each row (leftmost first on ties)."""
    order = score.masked_fill(~masked, NEG_INF).sort(dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return masked & (rank < count[:, None])


@dataclass(frozen=True)
class Policy:
    name: str
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    threshold: float | None = None  # threshold rule when set, else `steps` budget per block
    steps: int = 1

    @property
    def by_probability(self) -> bool:
        """Whether the score is the chosen token's probability: a greedy step then needs no distribution
        (ops/greedy_pick gives the token and its probability)."""
        return self.score is probability

    def select(self, probs, tokens, masked, steps_done) -> torch.Tensor:
        """probs [R, B, V], tokens/masked [R, B], steps_done [R] (steps taken in the current block)."""
        return self.choose(self.score(probs, tokens), masked, steps_done)

    def choose(self, score, masked, steps_done, ends=None) -> torch.Tensor:
        """The same from the positions' scores [R, B] (`self.score` of their distributions); `ends`
        [R, B]: the positions whose token is an end token (`select_threshold`)."""
        if self.threshold is not None:
            return select_threshold(score, masked, self.threshold, ends)
        left = (self.steps - steps_done).clamp_min(1)
        count = (masked.sum(1) + left - 1) // left  # ceil: the budget always finishes the block
        return select_count(score, masked, count)


SCORES = {"low_confidence": probability, "topk": probability, "entropy": neg_entropy, "margin": margin}


def make_policy(mode: str, block_size: int, threshold: float = DEFAULTS.threshold, steps: int | None = None) -> Policy:
    """`steps` (per block, for topk/entropy/margin) defaults to block_size // 4: ~4 tokens per step."""
    if mode not in SCORES:
        raise ValueError(f"unknown diffusion policy {mode!r} (known: {', '.join(SCORES)})")
    if mode == "low_confidence":
        check_threshold(threshold)
        return Policy(mode, probability, threshold=threshold)
    return Policy(mode, SCORES[mode], steps=policy_steps(block_size, steps))
