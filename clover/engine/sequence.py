"""Host-side record of one request: what it asked for and what it has produced so far."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Sequence:
    index: int  # order of arrival at the engine
    prompt_ids: list[int]
    max_new_tokens: int
    token_ids: list[int] = field(default_factory=list)
    trajectory: list[tuple[int, int]] = field(default_factory=list)  # per token: (block, step in block)
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    forward_passes: int = 0  # forwards this row took part in after the prompt prefill
    blocks: int = 0  # rounds completed (blocks, verify rounds, AR steps)
    started: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def seconds(self) -> float:
        return (self.finished_at or time.perf_counter()) - self.started

    def append(self, tokens: list[int], steps: list[int], eos: set[int]) -> None:
        """Add a round's tokens (already cut after the first EOS) and finish when due."""
        self.token_ids += tokens
        self.trajectory += [(self.blocks, s) for s in steps]
        self.blocks += 1
        if tokens and tokens[-1] in eos:
            self.finish("stop")
        elif self.remaining <= 0:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.finished_at = time.perf_counter()


def sequences(prompts: list[list[int]], budgets: list[int], context: int, first: int = 0) -> list[Sequence]:
    """The records of new rows (`first`: the index of the first), every prompt checked before any
    work: not empty, a budget >= 1, prompt + budget within the model's context."""
    if not prompts:
        raise ValueError("no prompts")
    if len(budgets) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(budgets)} max_new_tokens")
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if n < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {n}")
        if len(p) + n > context:
            raise ValueError(f"prompt {i} ({len(p)} tokens) + max_new_tokens ({n}) "
                             f"exceeds the model's context of {context} tokens")
    return [Sequence(first + i, list(p), n) for i, (p, n) in enumerate(zip(prompts, budgets))]
