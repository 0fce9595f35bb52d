"""The data-parallel share of one global batch (clover/distributed): which rows this process runs and
how the processes add their shares up. Used by the training objectives and by FSDP's batch split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Shard:
    """This process's rows [lo, hi) of a global batch (data parallel, clover/distributed) and the
    sum over processes. The objectives draw every random number for the WHOLE batch (so the
    generator advances as in one process), run the model on these rows only and return this
    shard's share of the global mean (divided by the global count): the shares of all processes
    add up to the loss one process computes on the whole batch."""

    lo: int
    hi: int
    world: int
    all_sum: Callable[[float], float]

    @property
    def empty(self) -> bool:
        """No rows here (a batch smaller than the world: evaluation's last batch); `take` then gives
        the first row, so this rank still runs the forward the others' collectives wait for, and
        the caller must zero its loss."""
        return self.lo == self.hi

    def take(self, x: torch.Tensor, copies: int = 1) -> torch.Tensor:
        """These rows of `x`, which holds `copies` stacked copies of the batch (complementary masking)."""
        if self.empty:
            return x[:1]
        if copies == 1:
            return x[self.lo:self.hi]
        batch = x.shape[0] // copies
        return torch.cat([x[c * batch + self.lo: c * batch + self.hi] for c in range(copies)])
