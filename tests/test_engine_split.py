"""A split step (engine/batch.py `RowBatch.split_commit`): when only some rows commit a clean
segment, those rows commit in a forward of their own and every row's window runs after it. The
tokens and the forwards each row counts are those of the one rectangular (padded) forward, on
random-weight models (Clover and the families, shift and no shift, rows waiting for their first
column), batches of odd prompt lengths whose rows finish blocks at different steps, rows joining
mid-run; and the split runs fewer columns in more model calls. Also: the head runs only on columns a
step may fill."""

from __future__ import annotations

import pytest
import torch
from test_families import VOCAB, confident, write_family

from clover.engine import DecodeConfig, Engine
from clover.engine.batch import RowBatch
from clover.models import CloverForBlockDiffusion, preset_config
from clover.models.family_seam import FamilySeam

LENGTHS = (5, 7, 11, 3, 9)


def prompts(vocab: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab - 2, (n,), generator=g).tolist() for n in LENGTHS]


def decode(model, split: int | None, cfg: DecodeConfig, ps, budgets, monkeypatch, join_late: bool = False):
    """(tokens per row, forwards per row, model calls, columns run) with `split_min_saved = split`."""
    monkeypatch.setattr(RowBatch, "split_min_saved", split)
    engine = Engine(model, cfg)
    calls = {"n": 0, "cols": 0}
    forward = engine.runner.forward

    def counted(ids, cache, **kw):
        calls["n"] += 1
        calls["cols"] += ids.numel()
        return forward(ids, cache, **kw)

    engine.runner.forward = counted
    first = len(ps) - 2 if join_late else len(ps)
    seqs = engine.add(ps[:first], budgets[:first])
    for p, n in zip(ps[first:], budgets[first:]):
        for _ in range(2):  # joins mid-block (not on entropy's 3-step block boundaries)
            engine.step()
        seqs += engine.add([p], [n])
    while engine.running:
        engine.step()
    return [s.token_ids for s in seqs], [s.forward_passes for s in seqs], calls["n"], calls["cols"]


def assert_split_equals_fused(model, cfg, ps, budgets, monkeypatch, join_late=False):
    fused = decode(model, None, cfg, ps, budgets, monkeypatch, join_late)
    split = decode(model, 0, cfg, ps, budgets, monkeypatch, join_late)
    assert split[:2] == fused[:2]
    assert split[2] > fused[2] and split[3] < fused[3]  # the split ran: more calls, fewer columns


@pytest.fixture(scope="module")
def clover_model():
    torch.manual_seed(1234)
    m = CloverForBlockDiffusion(preset_config("clover-tiny")).eval()
    m.lm_head.weight.data *= 40  # peaked distributions: several fills a step, blocks finishing apart
    return m


@pytest.mark.parametrize("mode,extra,join_late", [("low_confidence", {"threshold": 0.5}, False),
                                                   ("low_confidence", {"threshold": 0.7}, True),
                                                   ("entropy", {"steps": 3}, True)])  # fixed steps: rows apart by joining
def test_split_step_equals_the_rectangle_on_clover(clover_model, monkeypatch, mode, extra, join_late):
    cfg = DecodeConfig(mode=mode, block_size=8, prefill_chunk=8, max_new_tokens=64, **extra)
    ps = prompts(120)
    assert_split_equals_fused(clover_model, cfg, ps, [21, 13, 30, 17, 25], monkeypatch, join_late)


@pytest.mark.parametrize("mode", ["ar", "self_spec"])
def test_split_step_of_a_clean_window_equals_the_rectangle(clover_model, monkeypatch, mode):
    """AR's window is its last token, committed as fed (no draft): rows joining running ones commit
    their prompt's tail in a forward of their own, then every row runs its token (the server's rows
    then no longer carry the newcomers' prompt width). self_spec (plain steps of one clean token may
    split, its recorded draft and verify steps do not): the same tokens and forwards either way."""
    cfg = DecodeConfig(mode=mode, block_size=4, prefill_chunk=8, max_new_tokens=64)
    ps = prompts(120)
    if mode == "ar":
        assert_split_equals_fused(clover_model, cfg, ps, [21, 13, 30, 17, 25], monkeypatch, join_late=True)
        return
    fused = decode(clover_model, None, cfg, ps, [21, 13, 30, 17, 25], monkeypatch, join_late=True)
    assert decode(clover_model, 0, cfg, ps, [21, 13, 30, 17, 25], monkeypatch, join_late=True)[:2] == fused[:2]


@pytest.mark.parametrize("model_type,block", [("sdar", 4), ("llada2_moe", 4), ("Fast_dLLM_Qwen", 8)])
def test_split_step_equals_the_rectangle_on_the_families(tmp_path, monkeypatch, model_type, block):
    write_family(tmp_path, model_type)
    seam = FamilySeam(confident(tmp_path, model_type))
    cfg = DecodeConfig(block_size=block, threshold=0.6, max_new_tokens=64)
    ps = prompts(VOCAB)
    assert_split_equals_fused(seam, cfg, ps, [13, 9, 17, 11, 15], monkeypatch, join_late=True)


def test_split_pays_only_past_its_threshold(clover_model, monkeypatch):
    """A threshold no step's saved columns reach leaves every step one forward."""
    cfg = DecodeConfig(block_size=8, threshold=0.5, prefill_chunk=8, max_new_tokens=64)
    ps = prompts(120)
    fused = decode(clover_model, None, cfg, ps, [21, 13, 30, 17, 25], monkeypatch)
    high = decode(clover_model, 8 * len(ps) + 1, cfg, ps, [21, 13, 30, 17, 25], monkeypatch)
    assert high == fused


def test_head_runs_only_on_the_sub_block_a_step_fills(tmp_path):
    """Fast-dLLM v2 fills only each row's first sub-block with masks: a greedy step's head runs on
    those columns (union over rows), not on every masked column; tokens as the published loop's
    (tests/test_families_engine.py)."""
    write_family(tmp_path, "Fast_dLLM_Qwen")
    loaded = confident(tmp_path, "Fast_dLLM_Qwen")
    seam = FamilySeam(loaded)
    seam.sub_block = 4
    widths = []
    hook = loaded.model.lm_head.register_forward_hook(lambda mod, inp, out: widths.append(inp[0].shape[1]))
    try:
        engine = Engine(seam, DecodeConfig(block_size=16, threshold=0.95, max_new_tokens=32))
        engine.generate([prompts(VOCAB)[0]])
    finally:
        hook.remove()
    drafts = [w for w in widths if w > 1]
    assert drafts and all(w <= 4 or w >= 16 for w in drafts)  # a sub-block's columns, or a block's first step
    assert any(w <= 4 for w in drafts)
