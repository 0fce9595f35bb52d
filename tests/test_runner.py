"""The runner seam and the compile-friendly pieces, on a tiny random model (no compilation here:
tests/test_runner_compiled.py compiles)."""

import pytest
import torch

from clover.compile import is_steady
from clover.engine import DecodeConfig, Engine
from clover.engine.runner import CompiledRunner, EagerRunner, make_runner
from clover.models import CloverForBlockDiffusion
from clover.models.modeling_clover import commit_slots
from clover.ops.moe import grouped_experts, grouped_experts_op, naive_experts
from helpers import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(4321)


def test_engine_calls_the_model_only_through_its_runner(model, monkeypatch):
    """Every forward of a decode goes through runner.forward (prefill and steps), so a back end that
    replaces the runner sees them all."""
    calls = []
    real = EagerRunner.forward

    def spy(self, ids, cache, **kw):
        calls.append(ids.shape)
        return real(self, ids, cache, **kw)

    monkeypatch.setattr(EagerRunner, "forward", spy)
    direct = []
    monkeypatch.setattr(CloverForBlockDiffusion, "__call__", lambda self, *a, **k: direct.append(1) or
                        torch.nn.Module.__call__(self, *a, **k))
    seq = Engine(model, DecodeConfig(block_size=4, max_new_tokens=8, prefill_chunk=4)).generate([list(range(3, 14))])[0]
    assert len(calls) == len(direct) > seq.forward_passes  # prefill chunks + steps, nothing beside the runner


@pytest.mark.parametrize("mode", ["ar", "low_confidence", "self_spec"])
def test_prompt_chunks_fit_the_runner_cap(model, monkeypatch, mode):
    """A runner with a prefill cap (compiled: 64, what its graphs take) sees no forward of more columns
    than the cap, the prompt's last chunk fused with the first window included: that chunk leaves the
    window room (a 65-column AR forward ran eagerly; a 64-token tail with a 4-column window fed 68)."""
    monkeypatch.setattr(EagerRunner, "prefill_chunk", 8)
    cols = []
    real = EagerRunner.forward

    def spy(self, ids, cache, **kw):
        cols.append(ids.shape[1])
        return real(self, ids, cache, **kw)

    monkeypatch.setattr(EagerRunner, "forward", spy)
    cfg = DecodeConfig(mode=mode, block_size=4, max_new_tokens=6)
    ref = Engine(model, cfg.with_(prefill_chunk=512)).generate([list(range(3, 40))])[0]
    cols.clear()
    seq = Engine(model, cfg).generate([list(range(3, 40))])[0]
    assert max(cols) <= 8 and len(cols) > 5
    assert seq.token_ids == ref.token_ids


def test_runner_forward_equals_model_forward(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 120, (3, 13), generator=g)
    pad = torch.zeros(3, 13, dtype=torch.bool)
    pad[1, :4] = pad[2, :9] = True
    outs = []
    for call in ("model", "runner"):
        cache = model.new_cache(3, capacity=40)
        with torch.no_grad():
            if call == "model":
                a = model(ids[:, :5], cache=cache, clean_block_size=5, pad_mask=pad[:, :5], logits_to_keep=1).logits
                b = model(ids[:, 5:], cache=cache, block_size=4, draft_len=4, clean_block_size=4,
                          logits_to_keep=4, logits_index=torch.tensor([0, 2, 3])).logits
            else:
                r = make_runner("eager", model)
                a = r.forward(ids[:, :5], cache, clean_block_size=5, pad_mask=pad[:, :5], logits_to_keep=1)
                b = r.forward(ids[:, 5:], cache, block_size=4, draft_len=4, clean_block_size=4, logits_to_keep=4,
                              logits_index=torch.tensor([0, 2, 3]))
        outs.append((a, b, cache.lens, cache.key[3].clone()))
    for x, y in zip(*outs):
        assert torch.equal(x, y)


def _nonzero_slots_reference(lens, pad, n):
    """The obvious commit: (row, slot) of every real clean column, by `nonzero`."""
    valid = ~pad[:, :n] if pad is not None else torch.ones(len(lens), n, dtype=torch.bool)
    npad = (~valid).sum(1)
    rows, cols = torch.nonzero(valid, as_tuple=True)
    return rows, cols, lens[rows] + cols - npad[rows]


@pytest.mark.parametrize("n", [1, 5, 8])
def test_commit_slots_match_nonzero_reference(n):
    g = torch.Generator().manual_seed(n)
    lens = torch.randint(0, 20, (5,), generator=g)
    npad = torch.randint(0, n + 1, (5,), generator=g)
    pad = torch.arange(n)[None, :] < npad[:, None]
    for p in (pad, None):
        slots = commit_slots(lens, p, n)
        rows, cols, ref = _nonzero_slots_reference(lens, p, n)
        assert torch.equal(slots[rows, cols], ref)  # real columns land where the reference puts them
        assert all(len(set(r.tolist())) == n for r in slots)  # distinct slots per row: no write races
        assert bool((slots < (lens + n)[:, None]).all()) and bool((slots >= 0).all())  # inside the reserved room
        kept = lens + n - (p.sum(1) if p is not None else 0)
        if p is not None:  # pads go past the new length, where nothing is read
            assert bool((slots[p] >= kept[:, None].expand(-1, n)[p]).all())


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_expert_custom_op_equals_eager_and_naive(tokens):
    g = torch.Generator().manual_seed(tokens)
    e, h, i, k = 6, 16, 8, 2
    x = torch.randn(tokens, h, generator=g)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    top_w, top_idx = torch.softmax(torch.randn(tokens, e, generator=g), -1).topk(k, dim=-1)
    ref = naive_experts(x, top_idx, top_w, gate_up, down)
    assert torch.equal(grouped_experts_op(x, top_idx, top_w, gate_up, down), grouped_experts(x, top_idx, top_w, gate_up, down))
    torch.testing.assert_close(grouped_experts_op(x, top_idx, top_w, gate_up, down), ref, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(grouped_experts_op, (x, top_idx, top_w, gate_up, down), test_utils=("test_schema", "test_faketensor"))


def test_static_layout_equals_prefix_layout(model):
    """Writing K/V into the cache in place and reading its whole capacity (masked) gives the logits
    of reading the longest prefix: rows of different lengths, a window that commits a clean block
    with a left pad (commit slots) and drafts the next (scratch slots), then a step reading what it
    committed."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 120, (2, 11), generator=g)
    prompt_pad = torch.zeros(2, 11, dtype=torch.bool)
    prompt_pad[1, :3] = True  # row 1 is 3 tokens shorter
    window = torch.randint(0, 120, (2, 8), generator=g)
    window_pad = torch.zeros(2, 8, dtype=torch.bool)
    window_pad[0, 0] = True  # row 0 commits 3 of its 4 clean columns
    after = torch.randint(0, 120, (2, 1), generator=g)
    outs = []
    for static in (False, True):
        cache = model.new_cache(2, capacity=64)
        with torch.no_grad():
            model(prompt, cache=cache, pad_mask=prompt_pad)
            layout = model.prepare_stream(window, cache, 4, 4, 4, window_pad, static=static)
            first = model.head(model.model(window, layout, cache), 8)
            model.commit_lens(cache, 4, window_pad)
            layout = model.prepare_stream(after, cache, static=static)
            outs.append((first, model.head(model.model(after, layout, cache), 1), cache.lens.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_steady_shapes_and_bucketed_capacity(model):
    assert is_steady(0, 8) and is_steady(1, 1) and is_steady(8, 16) and is_steady(32, 32)
    assert not is_steady(7, 15) and not is_steady(128, 129) and not is_steady(0, 65)
    assert CompiledRunner(model).new_cache(2, 300).capacity == 512


@pytest.mark.parametrize("clean, window, padded", [
    (9, 4, 12),  # 13 columns -> 16, not a 16-column clean segment (20)
    (15, 4, 16),  # 19 -> 24 would be 20 clean: the power of two is narrower (20 columns)
    (17, 0, 24), (21, 4, 28), (35, 0, 40), (29, 4, 32),  # multiples of 8 past 16 columns, not 32 / 64
    (60, 4, 60), (64, 4, 64),  # the clean segment stays within 64
    (3, 1, 3),  # 4 columns: already a bucket
])
def test_bucket_pads_the_clean_segment_to_the_narrowest_graph(clean, window, padded):
    from clover.compile import bucket, bucket_width

    ids = torch.arange(clean + window)[None].repeat(2, 1)
    pad = torch.zeros_like(ids, dtype=torch.bool)
    pad[1, :2] = True  # a shorter row keeps its padding; the new columns are padded for both rows
    out_ids, out_pad, width = bucket(ids, pad, clean)
    assert width == padded and out_ids.shape == (2, padded + window)
    assert torch.equal(out_ids[:, padded - clean:], ids) and torch.equal(out_pad[:, padded - clean:], pad)
    assert out_pad[:, :padded - clean].all()
    assert [bucket_width(n) for n in (1, 3, 9, 16, 17, 33, 64)] == [1, 4, 16, 16, 24, 40, 64]
    assert bucket(torch.zeros(1, 65 + 3, dtype=torch.long), None, 3) is None  # a window past 64 stays eager


def test_unknown_runner_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown runner"):
        DecodeConfig(runner="fast").validate()


def test_replay_checks_the_captured_shapes_and_strides():
    """A Replay calls its graph only with inputs laid out as captured; anything else returns None
    (the runner then goes through dynamo, which recompiles or raises)."""
    from clover.compile import Replay

    m = torch.nn.Linear(3, 1, bias=False)
    w = m.weight
    replay = Replay(lambda a, b: (a * b, a), [None, w], ["ids"], [(0, (2, 3), (3, 1))], m, {1: "weight"})
    x = torch.randn(2, 3)
    torch.testing.assert_close(replay(x, None, None), x * w)
    assert replay(torch.randn(3, 2).t(), None, None) is None  # same shape, other strides
    assert replay(torch.randn(1, 3), None, None) is None
    m.weight = torch.nn.Parameter(torch.randn(1, 3))  # a replaced weight is rebound...
    torch.testing.assert_close(replay(x, None, None), x * m.weight)
    m.weight = torch.nn.Parameter(torch.randn(3, 1))  # ...unless laid out otherwise: the Replay retires
    assert not replay.current() and replay(x, None, None) is None


def test_replay_of_a_recorded_forward_stores_its_records():
    """A recorded forward's graph returns the records its layers stored on the cache beside the
    logits: the Replay stores them again (fresh tensors of this call, None fields kept); a record
    tensor that is not a graph output, or a graph output that is neither, means no Replay."""
    from types import SimpleNamespace

    from clover.compile import Replay
    from clover.models.cache_clover import GdnRecord

    m = torch.nn.Linear(3, 1, bias=False)

    def fn(x, w):  # logits, then one record's eight tensors (the pad field None)
        return (x * w, *(x + i for i in range(8)))

    x = torch.randn(2, 3)
    outputs = fn(x, m.weight)
    cache = SimpleNamespace(recording=True, recorded={0: GdnRecord(*outputs[1:], None)}, tensors=lambda: {})
    record = {"fn": fn, "inputs": [x, m.weight], "outputs": outputs}
    replay = Replay.build(dict(record), m, outputs[0], x, None, cache)
    assert replay is not None and replay.records
    cache.recorded = {}
    y = torch.randn(2, 3)
    torch.testing.assert_close(replay(y, None, cache), y * m.weight)
    rec = cache.recorded[0]
    assert rec.pad is None and all(torch.equal(t, y + i) for i, t in enumerate(rec[:8]))
    cache.recorded = {0: GdnRecord(*outputs[1:8], torch.zeros(1), None)}  # one record tensor made outside the graph
    assert Replay.build(dict(record), m, outputs[0], x, None, cache) is None
    cache.recorded = {}  # an output nothing accounts for: a side effect the Replay would skip
    assert Replay.build(dict(record), m, outputs[0], x, None, cache) is None


def test_replay_bindings_see_every_replaced_module_parameter_and_buffer():
    """A Replay's weight check (`Bindings`): unchanged after in-place updates, changed when any
    submodule, parameter or buffer of the model is replaced or removed."""
    from clover.compile.replay import Bindings

    def owner_of(model, kind):
        return next(m for m in model.modules() if next(getattr(m, kind)(recurse=False), None) is not None)

    for change in ("in place", "parameter", "module", "buffer", "removed"):
        model = tiny_model(4322)
        model.lm_head.register_buffer("probe", torch.zeros(3))
        bindings = Bindings(model)
        assert bindings.unchanged()
        if change == "in place":
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
        elif change == "parameter":
            owner = owner_of(model, "parameters")
            name, param = next(owner.named_parameters(recurse=False))
            setattr(owner, name, torch.nn.Parameter(param.detach().clone()))
        elif change == "module":
            model.model.layers[0] = torch.nn.Identity()
        elif change == "buffer":
            model.lm_head._buffers["probe"] = torch.zeros(3)  # a direct store write counts too
        else:
            owner = owner_of(model, "parameters")
            delattr(owner, next(owner.named_parameters(recurse=False))[0])
        assert bindings.unchanged() == (change == "in place"), change
