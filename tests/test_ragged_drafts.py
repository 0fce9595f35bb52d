"""Slot jobs whose whole-window drafts have different widths share one forward (engine/slots.forward: the
narrower windows right-padded, `draft_lens` in the model's stream layout): each job's logits and cache equal
its forwards alone (the slow reference), on random prompts of odd lengths, jobs of several rows, with and
without a pending clean segment; partition groups them only where the model takes per-row widths."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model, with_block_additions

from clover.engine.batch import Forward, RowBatch
from clover.engine.runner import make_runner
from clover.engine.sequence import sequences
from clover.engine.slots import SlotJob, forward, partition


@pytest.fixture(scope="module")
def model():
    return with_block_additions(tiny_model(5))


def _jobs(model, prompts, widths, clean_bs):
    runner, jobs = make_runner("eager", model), []
    for rows, width in zip(prompts, widths):
        b = RowBatch.for_runner(runner, width, clean_bs, model.config.mask_token_id, "cpu", 512)
        b.join(sequences(rows, [8] * len(rows), model.config.max_position_embeddings),
               capacity=max(map(len, rows)) + 3 * max(widths))
        job = SlotJob(None)
        job.batch = b
        jobs.append(job)
    return jobs


def _plan(jobs, windows):
    for job, w in zip(jobs, windows):
        n = w.shape[1]
        job.need = Forward(w, n, n, n)


@pytest.mark.parametrize("clean_bs", [1, 3])
def test_jobs_of_different_widths_in_one_forward_equal_each_alone(model, clean_bs):
    g = torch.Generator().manual_seed(clean_bs)
    shapes, widths = [[11, 4], [7], [13, 9, 5], [6]], [3, 7, 5, 2]
    prompts = [[torch.randint(0, 100, (n,), generator=g).tolist() for n in rows] for rows in shapes]
    windows = [[torch.randint(0, 100, (len(rows), w), generator=g) for rows, w in zip(prompts, widths)]
               for _ in range(2)]  # the first forward commits the prompts' last tokens, the second commits nothing

    alone, shared = _jobs(model, prompts, widths, clean_bs), _jobs(model, prompts, widths, clean_bs)
    for k in range(2):
        want = []
        for job, w in zip(alone, windows[k]):
            _plan([job], [w])
            want += forward([job])
        _plan(shared, windows[k])
        assert len(partition(shared)) == 1
        got = forward(shared)
        for a, b, w in zip(got, want, widths):
            assert a.shape == b.shape == (b.shape[0], w, b.shape[2])
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
    for a, b in zip(shared, alone):
        assert torch.equal(a.batch.cache.lens, b.batch.cache.lens)
        for path, t in b.batch.cache.tensors().items():
            for r, n in enumerate(b.batch.cache.lens.tolist()):  # K/V past a row's length: scratch
                x, y = a.batch.cache.get(path)[r], t[r]
                x, y = (x[:, :n], y[:, :n]) if path[0] in ("key", "value") else (x, y)
                torch.testing.assert_close(x, y, atol=2e-4, rtol=2e-4)


def test_the_padding_is_what_the_model_masks(model):
    """Without `draft_lens` a right-padded window is another block (wider, its padding seen): the logits
    of a row's real columns change, so the equality above is the masking's doing."""
    g = torch.Generator().manual_seed(9)
    prompt = [torch.randint(0, 100, (9,), generator=g).tolist()]
    window = torch.randint(0, 100, (1, 4), generator=g)
    outs = []
    for lens in ([4], None):
        (job,) = _jobs(model, [prompt], [4], 1)
        padded = torch.cat([window, torch.full((1, 3), model.config.mask_token_id)], dim=1)
        kw = {"draft_lens": lens} if lens else {}
        outs.append(job.batch.forward(padded, 7, 7, 7, **kw)[:, :4])
    (job,) = _jobs(model, [prompt], [4], 1)
    alone = job.batch.forward(window, 4, 4, 4)
    torch.testing.assert_close(outs[0], alone, atol=2e-4, rtol=2e-4)
    assert not torch.allclose(outs[1], alone, atol=1e-2)


def test_partition_keeps_widths_apart_where_the_model_takes_one_width(model, monkeypatch):
    jobs = _jobs(model, [[[1, 2, 3]], [[4, 5]], [[6, 7, 8, 9]]], [3, 5, 3], 1)
    _plan(jobs, [torch.ones(1, w, dtype=torch.long) for w in (3, 5, 3)])
    assert [len(g) for g in partition(jobs)] == [3]
    monkeypatch.setattr(type(model), "ragged_drafts", False)
    assert sorted(len(g) for g in partition(jobs)) == [1, 2]
    monkeypatch.undo()
    jobs[1].need = Forward(jobs[1].need.window, 5, 6, 5)  # not a whole-window draft
    assert sorted(len(g) for g in partition(jobs)) == [1, 2]
