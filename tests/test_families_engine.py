"""The public families decode through Clover's engine (engine/layout.py, models/family_seam.py):
its LowConfidence greedy decode gives the tokens of the family's published loop
(clover/models/reference_generate.py) at the same block size and threshold, alone and in a batch of
prompts of different (odd) lengths; `ar` / `self_spec` are refused in one line where the family has
no shift. Tiny random folders in the published layout (tests/test_families.py writes them)."""

from __future__ import annotations

import pytest
import torch
from test_families import VOCAB, confident, write_family

from clover.engine import DecodeConfig, Engine
from clover.models.family_seam import FamilySeam
from clover.models.reference_generate import llada2_generate, sdar_generate

B, THRESHOLD = 4, 0.6
LENGTHS = (5, 7, 8, 3)  # odd, a whole block, shorter than a block


def prompts(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def budget(n: int) -> int:
    """Tokens up to the end of the third block after the prompt's (the published loops fill whole blocks)."""
    return (n // B + 3) * B - n


def reference(model_type, model, mask, prompt):
    x = torch.tensor([prompt])
    if model_type == "llada2_moe":
        out, _ = llada2_generate(model, x, mask, budget(len(prompt)), block_length=B, steps=B, threshold=THRESHOLD)
    else:
        out, _ = sdar_generate(model, x, mask, budget(len(prompt)), block_length=B, threshold=THRESHOLD)
    return out[0, len(prompt):len(prompt) + budget(len(prompt))].tolist()


def engine_tokens(seam, batch):
    cfg = DecodeConfig(block_size=B, threshold=THRESHOLD, max_new_tokens=64)
    engine = Engine(seam, cfg)
    seqs = engine.add(batch, [budget(len(p)) for p in batch])
    while engine.running:
        engine.step()
    return [s.token_ids for s in seqs], [s.forward_passes for s in seqs]


@pytest.mark.parametrize("model_type", ["sdar", "sdar_moe", "llada2_moe"])
def test_engine_equals_the_published_loop(tmp_path, model_type):
    write_family(tmp_path, model_type)
    loaded = confident(tmp_path, model_type)
    seam = FamilySeam(loaded)
    ps = prompts()
    want = [reference(model_type, loaded.model, loaded.mask_token_id, p) for p in ps]
    alone = [engine_tokens(seam, [p])[0][0] for p in ps]
    together, forwards = engine_tokens(seam, ps)
    assert alone == want and together == want
    assert all(len(t) == budget(len(p)) for t, p in zip(want, ps))
    assert min(len(t) / f for t, f in zip(together, forwards)) > 1  # the threshold fills several per forward


@pytest.mark.parametrize("mode", ["ar", "self_spec"])
def test_ar_and_self_spec_are_refused_without_shift(tmp_path, mode):
    write_family(tmp_path, "sdar")
    seam = FamilySeam(confident(tmp_path, "sdar"))
    with pytest.raises(ValueError, match="no shift") as e:
        Engine(seam, DecodeConfig(mode=mode, block_size=B))
    assert "\n" not in str(e.value)
