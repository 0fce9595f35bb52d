"""The engine sees a model seam (engine/model_api.py), not CloverForBlockDiffusion: Clover provides it,
a family laid out in a way the engine has no windows for (no shift with relative blocks) is refused
in one line, and a stand-in that
provides the seam decodes."""

from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_model

from clover.engine import DecodeConfig, Engine
from clover.engine.model_api import seam_of
from clover.models import CloverForBlockDiffusion


def test_clover_provides_the_seam():
    model = tiny_model(0)
    seam = seam_of(model)
    assert (seam.shift, seam.block_align) == (True, "relative")
    assert (seam.mask_id, seam.max_block_size, seam.context) == (
        model.config.mask_token_id, model.config.max_block_size, model.config.max_position_embeddings)
    assert (CloverForBlockDiffusion.shift, CloverForBlockDiffusion.block_align) == (True, "relative")
    assert Engine(model, DecodeConfig(block_size=4)).seam == seam


class Other(torch.nn.Module):
    """A family laid out otherwise."""

    def __init__(self, model, shift, block_align):
        super().__init__()
        self.inner, self.shift, self.block_align, self.config = model, shift, block_align, model.config

    def new_cache(self, rows, capacity):
        return self.inner.new_cache(rows, capacity=capacity)


@pytest.mark.parametrize("shift, align, why", [(False, "relative", "shift=False"), (True, "sideways", "block_align")])
def test_a_family_the_engine_cannot_lay_out_is_refused_in_one_line(shift, align, why):
    with pytest.raises(ValueError, match=why) as e:
        Engine(Other(tiny_model(0), shift, align), DecodeConfig(block_size=4))
    assert "\n" not in str(e.value)


def test_the_engine_reads_the_model_through_the_seam_only():
    """A stand-in with only the seam's parts (config fields, new_cache, the forward) decodes."""
    model = tiny_model(0)
    calls = []

    class StandIn:
        shift, block_align = True, "relative"
        device = model.device
        config = SimpleNamespace(mask_token_id=model.config.mask_token_id, max_block_size=model.config.max_block_size,
                                 max_position_embeddings=model.config.max_position_embeddings)

        def new_cache(self, rows, capacity):
            return model.new_cache(rows, capacity=capacity)

        def __call__(self, ids, **kw):
            calls.append(ids.shape)
            return model(ids, **kw)

    cfg = DecodeConfig(block_size=4, max_new_tokens=6)
    want = Engine(model, cfg).generate([[5, 6, 7]])[0].token_ids
    assert Engine(StandIn(), cfg).generate([[5, 6, 7]])[0].token_ids == want and calls
