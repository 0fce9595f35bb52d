"""A grammar as the token hook of `ar` (engine/modes.TokenHook): the next token of a row from its
logits, masked by what the grammar allows, and the grammar advanced by the token taken. Used by
`infill.decode_constrained` (Clover's layout) and `family_grammar` (a public family's blocks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..settings import SamplingParams
from .sampling import draw_distribution

AT_ONE = SamplingParams(temperature=1.0)  # a retry's draw: the model's own distribution


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
    params: SamplingParams | None = None  # how `generator` draws (None: at temperature 1)
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
        return int(constrained_sample(logits, self.params or AT_ONE, self.generator)[0])


def constrained_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """logits [B, V], the tokens a grammar forbids at -inf -> a token per row drawn with `params` (temperature,
    top_k, top_p: `sampling.draw_distribution`) from the model's distribution restricted to the allowed
    tokens. A row that allows nothing gives token 0 (its logit -inf: the caller sees the dead end)."""
    dead = ~torch.isfinite(logits).any(-1)
    probs = draw_distribution(logits.float(), params).cpu()
    if dead.any():
        probs[dead.cpu()] = torch.nn.functional.one_hot(torch.tensor(0), probs.shape[-1]).to(probs.dtype)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
