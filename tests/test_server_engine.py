"""The engine extensions the server relies on: per-row token budgets in one batch, and rows that
leave between steps (client gone) without changing the others' output, their cache rows freed."""

import pytest
import torch

from clover.engine import DecodeConfig, Engine
from clover.models import CloverForBlockDiffusion, preset_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = CloverForBlockDiffusion(preset_config("clover-tiny")).eval()
    m.lm_head.weight.data *= 40
    return m


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21]]


@pytest.mark.parametrize("mode", ["low_confidence", "ar", "self_spec"])
def test_per_row_budgets_equal_separate_runs(model, mode):
    budgets = [3, 11, 7, 16]
    cfg = lambda n: DecodeConfig(mode=mode, block_size=4, threshold=0.5, max_new_tokens=n)  # noqa: E731
    together = Engine(model, cfg(8))
    seqs = together.add(PROMPTS, max_new_tokens=budgets)
    while together.running:
        together.step()
    for seq, prompt, n in zip(seqs, PROMPTS, budgets):
        alone = Engine(model, cfg(n)).generate([prompt])[0]
        assert seq.token_ids == alone.token_ids and len(seq.token_ids) == n and seq.finish_reason == "length"
    assert together.cache is None  # nothing runs: the cache is gone


def test_finish_mid_block_frees_rows_and_keeps_the_others(model):
    cfg = DecodeConfig(block_size=4, threshold=0.5, max_new_tokens=12)
    ref = Engine(model, cfg).generate(PROMPTS)
    engine = Engine(model, cfg)
    seqs = engine.add(PROMPTS)
    engine.step()
    engine.step()
    engine.finish(seqs[1])
    assert seqs[1].finish_reason == "cancelled" and engine.cache.batch_size == 3 and len(engine.seqs) == 3
    engine.finish(seqs[1])  # twice is harmless
    late = engine.add([[30, 31, 32]], max_new_tokens=[5])[0]  # a new row joins after the cancel
    while engine.running:
        engine.step()
    for r in (0, 2, 3):
        assert seqs[r].token_ids == ref[r].token_ids
    assert late.token_ids == Engine(model, DecodeConfig(block_size=4, threshold=0.5, max_new_tokens=5)).generate([[30, 31, 32]])[0].token_ids
    with pytest.raises(ValueError, match="2 prompts but 1"):
        engine.add([[1], [2]], max_new_tokens=[3])
