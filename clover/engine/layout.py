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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    shift: bool = True
    absolute: bool = False

    @classmethod
    def of(cls, seam) -> "Layout":
        return cls(seam.shift, seam.block_align == "absolute")

    def prefilled(self, prompt: list[int], block_size: int) -> list[int]:
        """The prompt tokens committed before the first window."""
        if self.absolute:
            return prompt[: len(prompt) - self.fixed(prompt, block_size)]
        return prompt[:-1]

    def fixed(self, prompt: list[int], block_size: int) -> int:
        """Leading columns of the first window that hold prompt tokens and are no targets."""
        return len(prompt) % block_size if self.absolute else 0

    def first_window(self, prompt: list[int], block_size: int, width: int, mask_id: int) -> list[int]:
        """The first window of a row: the prompt tokens not prefilled, then masks."""
        known = prompt[len(self.prefilled(prompt, block_size)):]
        return known + [mask_id] * (width - len(known))
