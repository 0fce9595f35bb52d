"""Drafts looked up in a row's own context (prompt lookup): the tokens that followed the most recent
earlier occurrence of the context's longest suffix n-gram. Free to make (no forward), so a
self_spec round with such a draft is one verify forward; lossless like every self_spec draft (the
verify keeps only what greedy `ar` would have made). `NgramIndex` keeps, per n, where each n-gram
last ended, updated as tokens arrive; `draft_reference` scans the context (the reference)."""

from __future__ import annotations

SIZES = (4, 3, 2)  # n-gram sizes tried, longest first


def continuation(ctx: list[int], end: int, k: int) -> list[int]:
    """The k tokens from `ctx[end]` on; past the context's end the draft repeats itself with the
    period `len(ctx) - end` (a loop the context is in goes on)."""
    out: list[int] = []
    for j in range(k):
        p = end + j
        out.append(ctx[p] if p < len(ctx) else out[p - len(ctx)])
    return out


def draft_reference(ctx: list[int], k: int, sizes: tuple[int, ...] = SIZES) -> list[int] | None:
    """The draft of `k` tokens for `ctx` by a backward scan, None when no suffix n-gram occurred before."""
    n_ctx = len(ctx)
    for n in sizes:
        tail = ctx[n_ctx - n:] if n_ctx >= n else None
        for i in range(n_ctx - n - 1, -1, -1):
            if ctx[i:i + n] == tail:
                return continuation(ctx, i + n, k)
    return None


class NgramIndex:
    """One row's context and, per n-gram size, the end of each n-gram's latest occurrence that has a
    token after it; `draft` equals `draft_reference(self.ctx, k)`."""

    def __init__(self, prompt: list[int], sizes: tuple[int, ...] = SIZES):
        self.ctx: list[int] = []
        self.prompt_len, self.sizes = len(prompt), sizes
        self.last: dict[int, dict[tuple, int]] = {n: {} for n in sizes}
        self.extend(prompt)

    @property
    def generated(self) -> int:
        """Tokens of the output indexed so far."""
        return len(self.ctx) - self.prompt_len

    def extend(self, tokens: list[int]) -> None:
        ctx = self.ctx
        for t in tokens:
            n_ctx = len(ctx)  # the n-grams ending here get a token after them
            for n in self.sizes:
                if n_ctx >= n:
                    self.last[n][tuple(ctx[n_ctx - n:])] = n_ctx
            ctx.append(t)

    def draft(self, k: int) -> list[int] | None:
        ctx = self.ctx
        for n in self.sizes:
            end = self.last[n].get(tuple(ctx[len(ctx) - n:])) if len(ctx) >= n else None
            if end is not None:
                return continuation(ctx, end, k)
        return None
