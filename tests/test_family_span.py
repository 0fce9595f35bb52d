"""A compiled family step whose attention reads only the cache slots in use (`span`,
compile.attention_span) against the same step over the whole capacity and against the eager
forward (block_step: the committed prefix, no scratch slots): the same logits and the same
committed K/V, for a batch of rows of odd, different lengths (left padding), eagerly (no compile:
the graphs run this code). The compiled graphs of it: tests/test_families_compiled.py."""

from __future__ import annotations

import pytest
import torch
from test_families import VOCAB, confident, write_family

from clover.compile import SPAN_MIN, attention_span

LENGTHS = (37, 5, 70)  # committed tokens per row: odd, different, one past the first span


def committed(model, lens, seed: int = 0):
    """A cache of the model whose rows hold `lens` committed random tokens (capacity 256)."""
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache(len(lens), capacity=256)
    width = max(lens)
    ids = torch.randint(4, VOCAB, (len(lens), width), generator=g)
    pad = torch.arange(width)[None, :] < torch.tensor([width - n for n in lens])[:, None]
    model(ids, cache=cache, commit=True, block_size=4, pad=pad)
    return cache


def step_inputs(folder, model_type: str, seed: int):
    """(model, generator, ids, pad) of a step over `committed` rows: a random-weight family model in
    `folder`, 5 clean columns and a 4-column draft per row, row 1 committing 2 of its clean columns."""
    write_family(folder, model_type)
    model = confident(folder, model_type).model
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (len(LENGTHS), 9), generator=g)
    pad = torch.zeros_like(ids, dtype=torch.bool)
    pad[1, :3] = True
    return model, g, ids, pad


@pytest.mark.parametrize("model_type", ["sdar", "llada2_moe", "Fast_dLLM_Qwen"])
def test_span_limited_step_equals_the_whole_capacity_and_eager(tmp_path, model_type):
    model, _, ids, pad = step_inputs(tmp_path, model_type, 1)
    span = attention_span(max(LENGTHS) + ids.shape[1], 256)
    assert span == 128 and SPAN_MIN == 64
    with torch.no_grad():
        outs = {}
        for name, s in (("span", span), ("whole", 0)):
            cache = committed(model, LENGTHS)
            outs[name] = (model.static_forward(ids, cache, 4, pad, 4, span=s), cache)
        ref_cache = committed(model, LENGTHS)
        ref = model(ids, cache=ref_cache, commit=5, block_size=4, pad=pad)[:, -4:]
    (got, cache), (whole, _) = outs["span"], outs["whole"]
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=3e-4)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=3e-4)
    cache.advance(5 - pad[:, :5].sum(1))
    assert cache.lens.tolist() == ref_cache.lens.tolist()
    for layer in ref_cache.key:
        for r, n in enumerate(ref_cache.lens.tolist()):
            torch.testing.assert_close(cache.key[layer][r, :, :n], ref_cache.key[layer][r, :, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache.value[layer][r, :, :n], ref_cache.value[layer][r, :, :n], rtol=1e-5,
                                       atol=1e-5)


def test_attention_span_buckets():
    assert [attention_span(n, 256) for n in (1, 64, 65, 128, 129, 256)] == [64, 64, 128, 128, 256, 256]
    assert attention_span(90, 96) == 96  # never past the capacity
    with pytest.raises(ValueError, match="capacity"):
        attention_span(300, 256)
