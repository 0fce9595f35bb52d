"""The model seam: what the engine (its row batch, modes and runner) needs of a block-diffusion model
family, instead of `CloverForBlockDiffusion` itself. Clover is the first family that provides it;
the published families (clover/models/modeling_family.py) declare the same properties.

A family provides:
* the forward over a row batch's layout and its cache: `model(input_ids, cache=, block_size=,
  draft_len=, clean_block_size=, pad_mask=, logits_to_keep=, logits_index=)` -> an output with
  `.logits`, `input_ids` [rows, L] = [clean segment ; draft window of `draft_len`];
* its cache type: `new_cache(rows, capacity=)`, with the row and record API the row batch and the
  modes use (`select_rows`, `append_rows`, `copy_rows`, `start_recording`, `rollback`);
* `config.mask_token_id` (the mask id), `config.max_block_size`, `config.max_position_embeddings`;
* `shift`: True when hidden state i predicts token i+1 (Clover, Fast-dLLM v2: a block of size 1 is
  the AR model), False when it predicts token i itself (SDAR, LLaDA2);
* `block_align`: "relative" (blocks start right after the prompt: Clover) or "absolute" (blocks at
  k*B from the first prompt token, the prompt's last partial block completed by generation);
* optionally `sub_block`: a block is filled sub-block by sub-block of this many columns (Fast-dLLM v2).

The engine lays windows out as engine/layout.py says: shift with relative blocks (Clover: [last
known token, MASK...], column j predicting target j), no shift with absolute blocks (SDAR, LLaDA2:
[prompt tail, MASK...], column j predicting itself), shift with absolute blocks (Fast-dLLM v2); no
shift with relative blocks is refused in one line (the family's reference loop, clover/models/reference_generate.py, decodes it). A stand-in
that declares neither property (a test's scripted model, a wrapper) is taken as laid out as Clover is.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

ALIGNS = ("relative", "absolute")


class BlockModel(Protocol):
    """The seam, as a type (see the module docstring)."""

    config: Any
    device: Any
    shift: bool
    block_align: str

    def new_cache(self, rows: int, capacity: int) -> Any: ...

    def __call__(self, input_ids, *, cache, block_size, draft_len, clean_block_size, pad_mask, logits_to_keep,
                 logits_index) -> Any: ...


class Seam(NamedTuple):
    """What the engine reads of a model once."""

    mask_id: int
    max_block_size: int
    context: int  # max_position_embeddings
    shift: bool
    block_align: str
    sub_block: int = 0  # fill only the first sub-block of this many columns that has masks (0: whole blocks)


def seam_of(model) -> Seam:
    """The model's seam; ValueError (one line) for a model the engine cannot lay out."""
    c = model.config
    seam = Seam(c.mask_token_id, c.max_block_size, c.max_position_embeddings, bool(getattr(model, "shift", True)),
                getattr(model, "block_align", "relative"), int(getattr(model, "sub_block", 0)))
    if seam.block_align not in ALIGNS:
        raise ValueError(f"{type(model).__name__}.block_align must be one of {', '.join(ALIGNS)}, "
                         f"got {seam.block_align!r}")
    if not seam.shift and seam.block_align == "relative":
        raise ValueError(f"{type(model).__name__}: the engine decodes models without shift in absolute blocks only; "
                         f"this one has shift={seam.shift}, {seam.block_align} blocks: decode it with its reference "
                         "loop (clover.models.reference_generate)")
    return seam
