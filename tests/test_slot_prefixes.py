"""Rows of concurrent slot jobs whose contexts share a prefix commit it once (engine/slots.share_prefixes):
the same logits and caches as the merged forward that feeds every row its whole context."""

from __future__ import annotations

import pytest
import torch
from helpers import prefilled_batches, tiny_model, with_block_additions

from clover.engine.batch import RowBatch, merge
from clover.engine.slots import prefix_groups, share_prefixes


@pytest.fixture(scope="module")
def model():
    """Block additions off zero: a prefix committed in the wrong window widths would change the logits."""
    return with_block_additions(tiny_model(3))


def _step(batch: RowBatch, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, 100, (len(batch.seqs), width), generator=g)
    return batch.forward(window, width, width, width)


@pytest.mark.parametrize("width", [1, 4, 5])
def test_a_shared_prefix_committed_once_equals_every_row_fed_whole(model, width, monkeypatch):
    monkeypatch.setattr(RowBatch, "split_min_saved", 1)
    g = torch.Generator().manual_seed(width)
    shared = torch.randint(0, 100, (37,), generator=g).tolist()
    tail = lambda n: torch.randint(0, 100, (n,), generator=g).tolist()  # noqa: E731
    prompts = [[shared + tail(7), shared + tail(16)], [shared + tail(7), shared[:20] + tail(5)],
               [shared + tail(16), tail(9)]]  # pairs of one length: one phase whatever the width
    plain = merge(prefilled_batches(model, prompts, width), width)
    cached = merge(prefilled_batches(model, prompts, width), width)
    calls = []
    runner = cached.runner
    monkeypatch.setattr(runner, "forward", lambda *a, f=runner.forward, **k: calls.append(a[0].shape) or f(*a, **k))
    share_prefixes(cached)
    assert calls and cached.pending[0].shape[1] < plain.pending[0].shape[1]  # a prefix ran once, the rows feed less
    for seed in range(3):  # the shared step, then two more on the caches it left
        a, b = _step(plain, width, seed), _step(cached, width, seed)
        torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)
    assert torch.equal(plain.cache.lens, cached.cache.lens)


def test_prefix_groups_share_only_window_boundaries_of_each_row():
    a, b = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 9, 9, 9, 9]  # lengths 7 and 9: one phase modulo 2, not 4
    assert prefix_groups([a, b], 2) == [([0, 1], 5)]
    assert prefix_groups([a, b], 4) == [([0], 3), ([1], 5)]  # apart: each up to its boundary below 5
    assert prefix_groups([a, b, None], 1) == [([0, 1], 5)]
    assert prefix_groups([a, [8] + a[1:]], 2) == []  # nothing shared
    assert prefix_groups([a, list(a)], 3) == [([0, 1], 7)]  # the whole context: the rows' pending is empty
