"""A public family's model behind the engine's model seam (clover/engine/model_api.py), so Clover's
engine, modes and server decode it. The family's forward already commits a clean segment and runs a
draft in one call (modeling_family.BlockFamilyModel.forward); this maps the seam's arguments onto
it and carries what the seam reads besides: the mask id the folder publishes, the context, `shift`
and `block_align`, and the family's published decoding defaults (`decode_defaults`)."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn



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
                   block: int, span: int = 0):
        """One compiled step: the logits of the last `logits_to_keep` columns; every column's K/V
        written into the cache in place, the attention reading its first `span` slots (0: all;
        modeling_family.static_block_step)."""
        return self.family_model.static_forward(ids, cache, block, pad_mask, logits_to_keep, span)

    span_limited = True  # its compiled steps read only the cache slots in use (compile.attention_span)

    @staticmethod
    def commit_lens(cache, num_clean: int, pad_mask=None) -> None:
        """After a compiled step wrote the clean columns: advance each row's committed length."""
        cache.advance(num_clean - (pad_mask.sum(1) if pad_mask is not None else 0))

    def new_cache(self, rows: int, capacity: int = 256):
        return self.family_model.new_cache(rows, capacity=capacity)

    def forward(self, input_ids, *, cache=None, block_size=None, draft_len=0, clean_block_size=None, pad_mask=None,
                logits_to_keep=0, logits_index=None, **_):
        """input_ids [rows, L] = [clean segment ; draft window of `draft_len`]: the clean segment is
        committed and the draft read against it, positions absolute (the family's own); logits of the
        last `logits_to_keep` columns (0: all), `logits_index` of those."""
        clean = input_ids.shape[1] - draft_len
        block = self.block_of(block_size, clean_block_size)
        hidden = self.family_model(input_ids, cache=cache, commit=clean if cache is not None else False,
                                   block_size=block, pad=pad_mask, hidden_only=True)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        if logits_index is not None:
            hidden = hidden[:, logits_index]
        return SimpleNamespace(logits=self.family_model.logits(hidden))
