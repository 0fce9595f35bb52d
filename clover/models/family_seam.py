"""A public family's model behind the engine's model seam (clover/engine/model_api.py), so Clover's
engine, modes and server decode it. The family's forward already commits a clean segment and runs a
draft in one call (modeling_family.BlockFamilyModel.forward); this maps the seam's arguments onto
it and carries what the seam reads besides: the mask id the folder publishes, the context, `shift`
and `block_align`, and the family's published decoding defaults (`decode_defaults`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from .modeling_family import tail_columns

HEAD_MIN = 8  # the fewest columns a masked-head step computes (`head_width`: powers of two from here)


class FamilySeam(nn.Module):
    def __init__(self, loaded):
        """`loaded`: a clover.models.families.LoadedFamily."""
        super().__init__()
        self.family_model = loaded.model
        self.family = loaded.family
        self.shift, self.block_align = loaded.model.shift, loaded.model.block_align
        c = loaded.model.config
        context = c.max_position_embeddings
        self.config = SimpleNamespace(mask_token_id=loaded.mask_token_id, max_block_size=context,
                                      block_size=loaded.block_size,
                                      max_position_embeddings=context, vocab_size=c.vocab_size,
                                      eos_token_id=list(loaded.eos_token_ids) or None, model_type=c.model_type)
        self.decode_defaults = {"block_size": loaded.block_size, "threshold": loaded.threshold}
        self.sub_block = getattr(loaded.model, "default_sub_block_size", 0)  # Fast-dLLM v2 fills sub-blocks of 8
        # every draft window's head on one sub-block (`trims`), asked or not; off: a call asks
        # (`sub_block_head`, a sub-block step's), others of the same shape (self_spec's drafts, the
        # structured paths) read other columns
        self.sub_block_head = False

    @property
    def device(self):
        return self.family_model.model.embed.weight.device

    @property
    def dtype(self):
        return self.family_model.model.embed.weight.dtype

    # ---- the compiled runner's three calls (engine/runner.py CompiledRunner, compile/state.py) ----
    def block_of(self, block_size=None, clean_block_size=None) -> int:
        """The absolute block size of a call: its blocks sit at k * block from the first prompt token."""
        return block_size or clean_block_size or self.decode_defaults["block_size"]

    def check_stream(self, input_ids, cache, block_size=None, draft_len=0, clean_block_size=None,
                     static: bool = False) -> tuple[int, int]:
        """Validate and make room in the cache (on the host, before the graph); (block, block): the
        family's one block size is all a compiled step specialises on besides the shapes."""
        length = input_ids.shape[1]
        if draft_len and not 1 <= draft_len <= length:
            raise ValueError(f"draft_len={draft_len} must be in [1, {length}]")
        if cache is not None:
            cache.reserve(length)  # every column gets a slot: the clean ones to commit, the draft's scratch
        block = self.block_of(block_size, clean_block_size)
        return block, block

    def graph_step(self, ids, pad_mask, cache, logits_to_keep: int, draft_len: int, clean_block_size: int,
                   block: int, span: int = 0, sub_block_head: bool = False, head: int = 0):
        """One compiled step: the logits of the last `logits_to_keep` columns; every column's K/V
        written into the cache in place, the attention reading its first `span` slots (0: all;
        modeling_family.static_block_step). A sub-block family's draft window (every column kept, no
        clean segment) of a sub-block step (`sub_block_head`) computes only the logits that step reads
        and returns those alone, [rows, sub_block, V] of the columns `sub_block_columns` (`trims`). With
        `head` (`head_width`: a greedy step without shift, its draft window alone), the last layer and
        the head run on `head` columns of the window, each row's masked columns among them, and the
        step returns those alone, [rows, head, V] of the columns `head_columns` names."""
        if head:
            cols = masked_columns(ids, self.config.mask_token_id, logits_to_keep or ids.shape[1], head)
            return self.family_model.static_forward(ids, cache, block, pad_mask, span=span, select=cols)
        if not self.trims(ids.shape[1], draft_len, logits_to_keep, asked=sub_block_head):
            return self.family_model.static_forward(ids, cache, block, pad_mask, logits_to_keep, span)
        cols = sub_block_columns(ids, self.config.mask_token_id, self.sub_block)
        logits = self.family_model.static_forward(ids, cache, block, pad_mask, span=span, select=cols)
        return logits if sub_block_head else spread(logits, cols, ids.shape[1])

    def trims(self, width: int, draft_len: int, keep: int, index=None, asked: bool = False) -> bool:
        """Whether a call is a sub-block family's draft window alone, every column kept, of a
        sub-block step (`asked`, or `sub_block_head` on for every call): that step reads the logits
        of one sub-block (`sub_block_columns`), the only ones computed. An asked call returns those
        alone ([rows, sub_block, V]); a call trimmed by `sub_block_head` alone returns every column's,
        the others 0."""
        return ((asked or self.sub_block_head) and bool(self.sub_block) and draft_len == width and keep in (0, width) and index is None
                and width % self.sub_block == 0 and width > self.sub_block)

    def head_width(self, ids, logits_to_keep: int, draft_len: int) -> int:
        """How many columns a step that asks for its head (`sub_block_head`) computes the last layer and
        the head on, in a family without shift: such a step (a greedy fill) reads the logits of its
        masked targets only, each its own column. The fewest power of two from HEAD_MIN holding every
        row's masked columns among the kept ones (the draft window), 0 where that is all of them, where
        more than the window is kept, or for a family with shift (its sub-block step: `trims`). The
        step then returns those columns' logits alone (`graph_step`, `head_columns`).
        Read on the host from the ids (a graph per width: `ShapeKey.head`)."""
        keep = logits_to_keep or ids.shape[1]
        if self.shift or keep != draft_len or keep <= HEAD_MIN:
            return 0
        most = int((ids[:, -keep:] == self.config.mask_token_id).sum(1).max())
        width = max(HEAD_MIN, 1 << max(most - 1, 0).bit_length())
        return width if width < keep else 0

    span_limited = True  # its compiled steps read only the cache slots in use (compile.attention_span)

    @staticmethod
    def commit_lens(cache, num_clean: int, pad_mask=None) -> None:
        """After a compiled step wrote the clean columns: advance each row's committed length."""
        cache.advance(num_clean - (pad_mask.sum(1) if pad_mask is not None else 0))

    def new_cache(self, rows: int, capacity: int = 256):
        return self.family_model.new_cache(rows, capacity=capacity)

    def forward(self, input_ids, *, cache=None, block_size=None, draft_len=0, clean_block_size=None, pad_mask=None,
                logits_to_keep=0, logits_index=None, sub_block_head=False, **_):
        """input_ids [rows, L] = [clean segment ; draft window of `draft_len`]: the clean segment is
        committed and the draft read against it, positions absolute (the family's own); logits of the
        last `logits_to_keep` columns (0: all), `logits_index` of those (the last layer and the head
        run on those only); `sub_block_head`: a sub-block step's draft, whose logits are those of its
        `sub_block_columns` alone, [rows, sub_block, V], where the seam `trims` it (`logits_index` is
        then ignored)."""
        width = input_ids.shape[1]
        block = self.block_of(block_size, clean_block_size)
        sub_block_head = sub_block_head and bool(self.sub_block)  # without sub-blocks: `logits_index` says
        asked_index = None if sub_block_head else logits_index  # a sub-block step's: its index slices, as a graph's
        cols = sub_block_columns(input_ids, self.config.mask_token_id, self.sub_block) \
            if self.trims(width, draft_len, logits_to_keep, asked_index, sub_block_head) else None
        keep = cols if cols is not None else tail_columns(input_ids, logits_to_keep)
        if cols is None and _column_list(logits_index):  # the last layer and the head on the indexed columns only
            keep = (width - (logits_to_keep or width) + logits_index).expand(input_ids.shape[0], -1)
            logits_index = None
        hidden = self.family_model(input_ids, cache=cache, commit=width - draft_len if cache is not None else False,
                                   block_size=block, pad=pad_mask, hidden_only=True, select=keep)
        if cols is not None:
            logits = self.family_model.logits(hidden)
            if sub_block_head:
                return SimpleNamespace(logits=logits)
            logits = spread(logits, cols, width)
            return SimpleNamespace(logits=logits if logits_index is None else logits[:, logits_index])
        if logits_index is not None:
            hidden = hidden[:, logits_index]
        return SimpleNamespace(logits=self.family_model.logits(hidden))


def _column_list(index) -> bool:
    """Whether `logits_index` is a 1-D integer tensor of columns (what `select` takes)."""
    return torch.is_tensor(index) and index.dim() == 1 and not index.is_floating_point() and index.dtype != torch.bool


def spread(logits: torch.Tensor, cols: torch.Tensor, width: int) -> torch.Tensor:
    """logits [R, n, V] of the columns `cols` [R, n] -> [R, width, V], the other columns 0."""
    full = logits.new_zeros(logits.shape[0], width, logits.shape[-1])
    return full.scatter(1, cols[:, :, None].expand(-1, -1, logits.shape[-1]), logits)


def masked_columns(ids: torch.Tensor, mask_id: int, keep: int, n: int) -> torch.Tensor:
    """[R, n] columns of the last `keep` of ids [R, L]: each row's columns holding the mask first (at
    most n of them), then its others, each group in column order."""
    start = ids.shape[1] - keep
    col = torch.arange(keep, device=ids.device)
    rank = torch.where(ids[:, start:] == mask_id, col, col + keep)
    return rank.topk(n, dim=1, largest=False).indices + start


def head_columns(window: torch.Tensor, mask_id: int, width: int, shift: bool, sub_block: int) -> torch.Tensor:
    """[R, width] the columns of a draft window [R, L] whose logits a step that asked for its head
    (`Forward.sub_block_head`) returned alone ([R, width, V], width < L): a sub-block step's
    (`sub_block_columns`, with shift) or a masked-head step's (`masked_columns`, without)."""
    if shift:
        return sub_block_columns(window, mask_id, sub_block)
    return masked_columns(window, mask_id, window.shape[1], width)


def sub_block_columns(window: torch.Tensor, mask_id: int, sub: int) -> torch.Tensor:
    """[R, sub] the columns of a shifted window [R, L] whose logits a sub-block step reads
    (engine/modes.advance): target j is column j + 1, so the first sub-block of columns holding a
    mask (column 0, the block's known first token, aside) is predicted by the columns one to the left
    of it, [sub * g - 1, sub * g + sub - 1), moved inside the window at its edges; with no mask left,
    the last `sub` columns (the block's last target)."""
    width = window.shape[1]
    col = torch.arange(width, device=window.device)
    group = torch.where((window == mask_id) & (col >= 1), col // sub, width // sub).amin(1, keepdim=True)
    return (group * sub - 1).clamp(0, width - sub) + torch.arange(sub, device=window.device)
