"""Where a row's windows sit, derived once from the model seam (engine/model_api.py): the row batch
(prefill, first window) and the diffusion mode (which column a target is, the next block's window)
read it instead of assuming Clover's layout.

* Clover (shift, relative blocks): prompt[:-1] is prefilled, the window is [last known token,
  MASK x (B-1)] and column j predicts target j (written to column j + 1); a finished block's last
  target starts the next window.
* SDAR, LLaDA2 (no shift, absolute blocks): blocks sit at k*B from the first prompt token. The
  prompt's whole blocks are prefilled; the first window holds the prompt's last L mod B tokens as
  fixed columns and masks the rest; column j predicts itself (target j is column j). Every later
  window is [MASK x B].
* Fast-dLLM v2 (shift, absolute blocks): windows as SDAR's, column j predicting target j (column
  j + 1) as Clover's; a block's first column is never drafted: it comes from the clean pass of the
  block before (the prompt's, when it ends on a block boundary), read from the forward that commits
  it (`commit_first`). Only the first sub-block (`sub_block` columns) that still has masks is filled.

`ar` decodes token after token from the prompt's end whatever the family's blocks (a block of one
token is the AR model of a family with shift); `self_spec`, whose drafts start anywhere, needs
relative blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import check_mode_layout


@dataclass(frozen=True)
class Layout:
    shift: bool = True
    absolute: bool = False
    sub_block: int = 0  # fill only the first sub-block of this many columns with masks (0: the whole block)

    @classmethod
    def of(cls, seam, mode: str = "low_confidence") -> "Layout":
        """The layout of `mode` on this model; ValueError (one line) for a mode that means nothing on it."""
        check_mode_layout(mode, seam.shift, seam.block_align == "absolute")
        if mode in ("ar", "self_spec"):
            return cls(seam.shift)
        return cls(seam.shift, seam.block_align == "absolute", seam.sub_block if seam.shift else 0)

    @property
    def commit_first(self) -> bool:
        """A block's first token comes from the clean pass of the block before."""
        return self.shift and self.absolute

    def prefilled(self, prompt: list[int], block_size: int) -> list[int]:
        """The prompt tokens committed before the first window."""
        if self.absolute:
            return prompt[: len(prompt) - self.fixed(prompt, block_size)]
        return prompt[:-1]

    def fixed(self, prompt: list[int], block_size: int) -> int:
        """Leading columns of the first window that hold prompt tokens."""
        return len(prompt) % block_size if self.absolute else 0

    def first_target(self, prompt: list[int], block_size: int) -> int:
        """The first target of a row's first block (-1: its first column waits for the clean pass)."""
        return self.fixed(prompt, block_size) - (1 if self.commit_first else 0)

    def first_window(self, prompt: list[int], block_size: int, width: int, mask_id: int) -> list[int]:
        """The first window of a row: the prompt tokens not prefilled, then masks."""
        known = prompt[len(self.prefilled(prompt, block_size)):]
        return known + [mask_id] * (width - len(known))
