"""RowCache.joined / rows_view (the caches of a shared slot forward, engine/batch.merge and split) against the
slow path they replace (copy_rows then append_rows of each, copy_rows of each batch's rows), on random caches of
odd sizes and capacities; pad_rows never takes another cache's rows as spare rows."""

from __future__ import annotations

import pytest
import torch
from helpers import prefilled_batches, tiny_model, with_block_additions

from clover.engine.batch import merge, split


@pytest.fixture(scope="module")
def model():
    return with_block_additions(tiny_model(3))


def _random_cache(model, rows: int, capacity: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache(rows, capacity=capacity)
    for path, t in cache.tensors().items():
        if path[0] == "lens":
            cache.lens = torch.randint(0, capacity, (rows,), generator=g)
        else:
            t.copy_(torch.randn(t.shape, generator=g))
    return cache


def _assert_same(a, b) -> None:
    assert a.batch_size == b.batch_size and a.capacity == b.capacity
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for path in ta:
        assert torch.equal(ta[path], tb[path]), path


@pytest.mark.parametrize("seed", range(4))
def test_joined_equals_copy_then_append_rows(model, seed):
    g = torch.Generator().manual_seed(100 + seed)
    sizes = torch.randint(1, 4, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
    caps = torch.randint(3, 40, (len(sizes),), generator=g).tolist()
    caches = [_random_cache(model, n, c, 10 * seed + i) for i, (n, c) in enumerate(zip(sizes, caps))]
    slow = caches[0].copy_rows()
    for c in caches[1:]:
        slow.append_rows(c)
    fast = caches[0].joined(caches[1:])
    _assert_same(fast, slow)
    assert fast.recorded == {} and all(fast.key[i].data_ptr() != caches[0].key[i].data_ptr() for i in fast.key)


def test_rows_view_writes_through_its_rows_only(model):
    cache = _random_cache(model, 5, 17, 7)
    before = {p: t.clone() for p, t in cache.tensors().items()}
    view = cache.rows_view(1, 3)
    _assert_same(view, cache.copy_rows(torch.arange(1, 4)))
    for i in view.state:
        view.state[i].fill_(3.0)
    for i in cache.state:
        assert bool((cache.state[i][1:4] == 3.0).all())
        assert torch.equal(cache.state[i][[0, 4]], before[("state", i)][[0, 4]])


def test_pad_rows_of_a_view_never_spares_the_other_rows(model):
    """A view of the first 3 rows of a 4-row cache, padded to 4 rows: the spare row is a new one, not row 3."""
    cache = _random_cache(model, 4, 9, 3)
    row3 = {p: t[3].clone() for p, t in cache.tensors().items() if p[0] != "lens"}
    padded = cache.rows_view(0, 3).pad_rows(4)
    for path, t in padded.tensors().items():
        if path[0] != "lens":
            t[3].fill_(-1.0)
    for path, t in cache.tensors().items():
        if path[0] != "lens":
            assert torch.equal(t[3], row3[path]), path
    again = padded.pad_rows(4)  # a base pad_rows made is reused
    assert all(again.key[i].data_ptr() == padded.key[i].data_ptr() for i in padded.key)


@pytest.mark.parametrize("width", [3, 5])
def test_merged_step_then_split_equals_each_batch_alone(model, width):
    """Batches of 1-3 rows of odd prompt lengths: a merged forward, split back, then each batch's own
    forward on its rows (views of the merged cache) give each batch's logits and caches alone."""
    g = torch.Generator().manual_seed(width)
    shapes = [[11, 4], [7], [13, 9, 5]]
    prompts = [[torch.randint(0, 100, (n,), generator=g).tolist() for n in rows] for rows in shapes]
    windows = [[torch.randint(0, 100, (len(rows), width), generator=g) for rows in prompts] for _ in range(2)]

    alone = prefilled_batches(model, prompts, width, spare_windows=3)
    want = [[b.forward(w, width, width, width) for b, w in zip(alone, windows[k])] for k in range(2)]
    shared = prefilled_batches(model, prompts, width, spare_windows=3)
    merged = merge(shared, width)
    logits = merged.forward(torch.cat(windows[0]), width, width, width)
    split(merged, shared)
    got = [list(logits.split([len(r) for r in prompts]))]
    got.append([b.forward(w, width, width, width) for b, w in zip(shared, windows[1])])
    for k in range(2):
        for a, b in zip(got[k], want[k]):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
    for a, b in zip(shared, alone):
        assert torch.equal(a.cache.lens, b.cache.lens)
        for path, t in b.cache.tensors().items():
            for r, n in enumerate(b.cache.lens.tolist()):  # K/V past a row's length: scratch
                x, y = a.cache.get(path)[r], t[r]
                x, y = (x[:, :n], y[:, :n]) if path[0] in ("key", "value") else (x, y)
                torch.testing.assert_close(x, y, atol=2e-4, rtol=2e-4)
