"""Memory of long contexts: no single allocation of a prefill (the engine's chunked one) or of a
decode step grows with the square of the context (bench/long_context.py measures the time and RSS).
The probe is checked against a forward that does grow so: the whole prompt in one forward, whose
attention mask is [L, L]."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from clover.engine import DecodeConfig, Engine
from clover.models import CloverForBlockDiffusion, preset_config

CHUNK = 64


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return CloverForBlockDiffusion(preset_config("clover-tiny", max_position_embeddings=4096)).eval()


def largest_allocation(fn) -> int:
    """Bytes of the largest memory any single op allocated itself while `fn` ran (CPU profiler)."""
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.self_cpu_memory_usage for e in prof.events())


def prompt(length: int) -> list[int]:
    return torch.randint(2, 100, (length,), generator=torch.Generator().manual_seed(length)).tolist()


@pytest.mark.parametrize("mode, block", [("ar", 1), ("low_confidence", 8)])
def test_prefill_and_decode_allocations_grow_at_most_linearly(model, mode, block):
    def run(length):
        cfg = DecodeConfig(mode=mode, block_size=block, max_new_tokens=2 * block, prefill_chunk=CHUNK)
        return lambda: Engine(model, cfg).generate([prompt(length)])

    small, large = largest_allocation(run(1024)), largest_allocation(run(2048))
    assert large <= 2.3 * small, (small, large)


def test_decode_step_allocations_grow_at_most_linearly(model):
    def step_at(length):
        cache = model.new_cache(1, capacity=length + 16)
        ids = torch.tensor([prompt(length)])
        with torch.inference_mode():
            for a in range(0, length, CHUNK):
                model(ids[:, a:a + CHUNK], cache=cache, logits_to_keep=1)
        return lambda: model(ids[:, :8], cache=cache, block_size=8, draft_len=8, logits_to_keep=8)

    small, large = largest_allocation(step_at(1024)), largest_allocation(step_at(2048))
    assert large <= 2.3 * small, (small, large)


@pytest.mark.parametrize("draft", [0, 8])
def test_a_decode_step_copies_no_cache(model, draft):
    """The keys a step attends to are the cache's own storage: no allocation of a step is as large as
    one attention layer's K over the context (a cat of the cache and the new keys would be)."""
    length = 2048
    cache = model.new_cache(1, capacity=length + 16)
    ids = torch.tensor([prompt(length)])
    with torch.inference_mode():
        for a in range(0, length, CHUNK):
            model(ids[:, a:a + CHUNK], cache=cache, logits_to_keep=1)
    layer = next(iter(cache.key.values()))
    one_layer_k = length * layer.shape[1] * layer.shape[3] * layer.element_size()
    n = draft or 1
    step = largest_allocation(lambda: model(ids[:, :n], cache=cache, block_size=8, draft_len=draft, logits_to_keep=n))
    assert step < one_layer_k / 2, (step, one_layer_k)


def test_the_probe_sees_a_quadratic_allocation(model):
    """One unchunked forward of the whole prompt builds an [L, L] mask: 4x at 2L."""
    def whole(length):
        ids = torch.tensor([prompt(length)])
        return lambda: model(ids, cache=model.new_cache(1, capacity=length), logits_to_keep=1)

    small, large = largest_allocation(whole(1024)), largest_allocation(whole(2048))
    assert large > 3.5 * small, (small, large)
