"""A public family's model behind the engine's model seam (clover/engine/model_api.py), so Clover's
engine, modes and server decode it. The family's forward already commits a clean segment and runs a
draft in one call (modeling_family.BlockFamilyModel.forward); this maps the seam's arguments onto
it and carries what the seam reads besides: the mask id the folder publishes, the context, `shift`
and `block_align`, and the family's published decoding defaults (`decode_defaults`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn.functional as F
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
        return self.family_model.head_weight().device

    @property
    def dtype(self):
        return self.family_model.head_weight().dtype

    def check_stream(self, *args, **kwargs):
        """What the compiled runner asks first: it does not run the families yet."""
        raise ValueError("the compiled runner does not run the public block-diffusion families yet: use runner eager")

    def new_cache(self, rows: int, capacity: int = 256):
        return self.family_model.new_cache(rows, capacity=capacity)

    def forward(self, input_ids, *, cache=None, block_size=None, draft_len=0, clean_block_size=None, pad_mask=None,
                logits_to_keep=0, logits_index=None, **_):
        """input_ids [rows, L] = [clean segment ; draft window of `draft_len`]: the clean segment is
        committed and the draft read against it, positions absolute (the family's own); logits of the
        last `logits_to_keep` columns (0: all), `logits_index` of those."""
        clean = input_ids.shape[1] - draft_len
        block = block_size or clean_block_size or self.decode_defaults["block_size"]
        hidden = self.family_model(input_ids, cache=cache, commit=clean if cache is not None else False,
                                   block_size=block, pad=pad_mask, hidden_only=True)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        if logits_index is not None:
            hidden = hidden[:, logits_index]
        return SimpleNamespace(logits=F.linear(hidden, self.family_model.head_weight()))
