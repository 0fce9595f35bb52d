"""A grammar as the token hook of `ar` (engine/modes.TokenHook): the next token of a row from its
logits, masked by what the grammar allows, and the grammar advanced by the token taken. Used by
`infill.decode_constrained` (Clover's layout) and `family_grammar` (a public family's blocks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Constraint:
    """The grammar of one row, as `ar`'s token hook (engine/modes.TokenHook): see `decode_constrained`."""

    allow: Callable[[torch.Tensor], None]
    accept: Callable[[int], bool]
    stops: set[int]
    generator: torch.Generator | None
    closers: Callable[[list[int]], list[int]] | None
    wrap_up: int
    max_new_tokens: int
    mask: int
    tokens: list[int] = field(default_factory=list)
    complete: bool = False
    forwards: int = 0

    def choose(self, logits: torch.Tensor, seq) -> tuple[int | None, bool]:
        self.forwards += 1
        logits[:, self.mask] = float("-inf")
        self.allow(logits)
        t = self.pick(logits, self.tokens, self.max_new_tokens - len(self.tokens))
        if not torch.isfinite(logits[0, t]):
            return None, True  # the grammar allows nothing here
        ok = self.accept(t)
        if t in self.stops:
            self.complete = True
            return None, True
        self.tokens.append(t)
        self.complete = not ok
        return t, not ok or len(self.tokens) >= self.max_new_tokens

    def pick(self, logits: torch.Tensor, tokens: list[int], left: int) -> int:
        late = self.closers is not None and left <= self.wrap_up
        closing = [c for c in self.closers(tokens) if torch.isfinite(logits[0, c])] if late else []
        if closing:
            return closing[0]
        if self.generator is None:
            return int(logits.argmax(-1))
        return int(torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=self.generator))
