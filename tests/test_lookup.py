"""self_spec with drafts looked up in the row's own context (engine/lookup.py, `draft="lookup"`):
the n-gram index against its backward-scan reference, and the decode against `ar` (lossless)."""

import random

import pytest
import torch

from clover.engine import DecodeConfig, Engine
from clover.engine.lookup import NgramIndex, continuation, draft_reference
from helpers import tiny_model


@pytest.mark.parametrize("seed", range(6))
def test_index_drafts_equal_the_reference_as_tokens_arrive(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 17])  # small vocabularies repeat n-grams often
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
    ix, ctx = NgramIndex(prompt), list(prompt)
    for _ in range(40):
        k = rng.randrange(1, 10)
        assert ix.draft(k) == draft_reference(ctx, k)
        new = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        ix.extend(new)
        ctx += new
        assert ix.ctx == ctx and ix.generated == len(ctx) - len(prompt)


def test_reference_by_hand():
    assert draft_reference([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]  # "1 2" came before: what followed it
    assert draft_reference([1, 2, 3], 2) is None  # no suffix n-gram (n >= 2) seen before
    assert draft_reference([5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]  # a loop goes on past the context's end
    assert continuation([7, 8, 9], 1, 4) == [8, 9, 8, 9]


@pytest.fixture(scope="module")
def looping_model():
    """Position-heavy embeddings (as test_engine's drafts-agree model): greedy outputs fall into loops."""
    m = tiny_model(1234, peak=1.0)
    w = m.model.embed_tokens.weight.data
    w.copy_(w[:1] + 0.3 * w)
    return m


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 120, (int(k),), generator=g).tolist() for k in torch.randint(1, 30, (n,), generator=g)]


def run(model, prompts, **kw):
    cfg = DecodeConfig(**{"max_new_tokens": 29, "prefill_chunk": 8, **kw})
    return Engine(model, cfg).generate(prompts)


@pytest.mark.parametrize("block", [3, 4, 8])
@pytest.mark.parametrize("which", ["random", "looping"])
def test_lookup_is_lossless_in_a_batch_of_odd_lengths(looping_model, which, block):
    model = tiny_model(99) if which == "random" else looping_model
    prompts = _prompts(block, 7) + [[4], [9, 9, 9, 9, 9]]
    ar = run(model, prompts, mode="ar")
    spec = run(model, prompts, mode="self_spec", block_size=block, draft="lookup")
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]
    assert all(s.finish_reason == "length" for s in spec)


def test_lookup_saves_forwards_on_loops_and_stops_at_eos(looping_model):
    prompts = _prompts(5, 4)
    ar = run(looping_model, prompts, mode="ar", max_new_tokens=48)
    spec = run(looping_model, prompts, mode="self_spec", block_size=8, draft="lookup", max_new_tokens=48)
    assert sum(s.forward_passes for s in spec) < 0.6 * sum(a.forward_passes for a in ar)
    eos = ar[0].token_ids[20]
    full = ar[0].token_ids
    got = run(looping_model, prompts[:1], mode="self_spec", block_size=8, draft="lookup", max_new_tokens=48,
              eos_token_ids=(eos,))[0]
    assert got.token_ids == full[: full.index(eos) + 1] and got.finish_reason == "stop"


def test_lookup_rows_joining_between_steps_equal_alone(looping_model):
    prompts = _prompts(11, 4)
    engine = Engine(looping_model, DecodeConfig(mode="self_spec", draft="lookup", block_size=4, max_new_tokens=20,
                                                prefill_chunk=8))
    first = engine.add(prompts[:2])
    engine.step()
    late = engine.add(prompts[2:])
    while engine.running:
        engine.step()
    for seq, p in zip(first + late, prompts):
        assert seq.token_ids == run(looping_model, [p], mode="ar", max_new_tokens=20)[0].token_ids


def test_unknown_draft_is_refused():
    with pytest.raises(ValueError, match="draft must be one of"):
        DecodeConfig(mode="self_spec", draft="guess")


def random_records(g, rows=3, n=5, layers=2, channels=6, kernel=4, heads=2, dk=3, dv=4):
    """Random GdnRecord fields (but the padding) of `layers` layers, flat, as rolled_states takes them."""
    flat = []
    for _ in range(layers):
        flat += [torch.randn(rows, channels, kernel - 1, generator=g), torch.randn(rows, heads, dk, dv, generator=g),
                 torch.randn(rows, channels, n, generator=g), torch.randn(rows, n, heads, dk, generator=g),
                 torch.randn(rows, n, heads, dk, generator=g), torch.randn(rows, n, heads, dv, generator=g),
                 -torch.rand(rows, n, heads, generator=g), torch.rand(rows, n, heads, generator=g)]
    return flat


def test_rolled_states_equal_the_naive_rule_on_the_kept_tokens():
    """cache_clover.rolled_states (self_spec's rollback): each row's states after its first keep[b]
    real tokens, behind npad[b] columns of padding, equal the naive rule run on those tokens alone
    and the conv state's last K-1 inputs of [conv state ; kept tokens]."""
    from clover.models.cache_clover import rolled_states
    from clover.ops.gated_delta_rule import naive_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    n = 5
    flat = random_records(g, n=n)
    npad, keep = torch.tensor([0, 2, 1]), torch.tensor([5, 1, 3])
    out = rolled_states(keep, npad, *flat)
    for layer in range(2):
        conv_before, state_before, stream, q, k, v, gate, beta = flat[8 * layer: 8 * layer + 8]
        for b in range(3):
            cols = slice(int(npad[b]), int(npad[b] + keep[b]))
            _, state = naive_gated_delta_rule(q[b:b + 1, cols], k[b:b + 1, cols], v[b:b + 1, cols],
                                              gate[b:b + 1, cols], beta[b:b + 1, cols], 1.0, state_before[b:b + 1])
            torch.testing.assert_close(out[2 * layer][b], state[0], rtol=1e-5, atol=1e-5)
            inputs = torch.cat([conv_before[b], stream[b, :, cols]], dim=-1)
            assert torch.equal(out[2 * layer + 1][b], inputs[:, -3:])
