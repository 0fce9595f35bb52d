"""The compiled runner (engine/runner.py CompiledRunner) on the public families: their steps as
static graphs (modeling_family.static_block_step: every column's K/V written into the cache in
place, the keys the cache slots in use masked past each row's length), replayed. The engine's decode
through it equals the eager runner's: fp32 logits of every call within 1e-5, the same tokens and
forwards, for a batch of prompts of odd lengths; a second decode of the same prompts compiles
nothing (no recompile) and replays every compiled step. Tiny random folders in the published
layout (tests/test_families.py writes them)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import runner_calls
from test_families import VOCAB, confident, write_family

from clover.compile import state_of
from clover.engine import DecodeConfig, Engine
from clover.engine.batch import RowBatch
from clover.models.family_seam import FamilySeam

THRESHOLD = 0.6
LENGTHS = (5, 7, 3)  # odd, longer than a block, shorter than one


def prompts(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def decode(seam, runner: str, batch, budgets, block: int):
    """(logits of every runner call, token ids, forwards per row, the runner)."""
    with runner_calls(runner) as logits:
        engine = Engine(seam, DecodeConfig(block_size=block, threshold=THRESHOLD, max_new_tokens=max(budgets),
                                           runner=runner))
        seqs = engine.add(batch, budgets)
        while engine.running:
            engine.step()
    return logits, [s.token_ids for s in seqs], [s.forward_passes for s in seqs], engine.runner


PEAK = 30.0  # the head's scale in `confident`: 1e-5 of the unscaled logits is PEAK * 1e-5 here


def same_logits(got, ref):
    """Equal per call (fp32, 1e-5 before the head's scaling); where the eager runner computed the head on some columns (`logits_index`) the
    compiled one may have returned them all (its head costs the same for every kept column)."""
    assert len(got) == len(ref)
    for (a, a_index), (b, b_index) in zip(got, ref):
        if a_index is None and b_index is not None:
            a = a[:, b_index]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=PEAK * 1e-5)


def graphs(seam):
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] + state_of(seam).fused_compiles


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model_type", ["sdar", "sdar_moe", "llada2_moe", "Fast_dLLM_Qwen"])
def test_compiled_family_decode_equals_eager(tmp_path, model_type, monkeypatch):
    write_family(tmp_path, model_type)
    seam = FamilySeam(confident(tmp_path, model_type, PEAK))
    block = 4
    if model_type == "Fast_dLLM_Qwen":
        seam.sub_block = 2  # sub-blocks of 2 in blocks of 4 (the published 8 in 32)
        monkeypatch.setattr(RowBatch, "split_min_saved", 1)  # split steps too: the window a sub-block step of its own
    batch, budgets = prompts(), [9, 6, 11]
    ref_logits, ref, ref_forwards, _ = decode(seam, "eager", batch, budgets, block)
    got_logits, got, forwards, runner = decode(seam, "compiled", batch, budgets, block)
    assert got == ref and forwards == ref_forwards
    assert all(len(t) == n for t, n in zip(got, budgets))
    same_logits(got_logits, ref_logits)
    assert runner.compiled_calls > 0 and runner.eager_calls == 0  # every step through a graph
    before = graphs(seam)
    again_logits, again, _, warm = decode(seam, "compiled", batch, budgets, block)
    assert graphs(seam) == before, "recompiled in a warm decode"
    assert again == ref
    same_logits(again_logits, ref_logits)
    assert warm.replayed_calls == warm.compiled_calls > 0  # every step a Replay: no dynamo guard evaluation


@pytest.mark.timeout(1800)
def test_cli_generate_compiled_on_a_family_folder(tmp_path):
    """`clover generate --model DIR --runner compiled` on a family folder: the eager runner's reply."""
    import json

    from test_families_engine import _clover

    write_family(tmp_path, "llada2_moe")
    args = ("generate", "--model", str(tmp_path), "--prompt", "Hello there", "--max-new-tokens", "9", "--json")
    eager, compiled = _clover(*args), _clover(*args, "--runner", "compiled")
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr
    assert json.loads(compiled.stdout)["text"] == json.loads(eager.stdout)["text"]


@pytest.mark.timeout(1800)
def test_compiled_steps_read_the_span_in_use(tmp_path):
    """Rows that grow past the first attention span (compile.attention_span: 64 slots, then 128)
    switch graphs mid-decode and still decode as the eager runner, every step through a graph."""
    write_family(tmp_path, "sdar")
    seam = FamilySeam(confident(tmp_path, "sdar", PEAK))
    g = torch.Generator().manual_seed(5)
    batch, budgets = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (53, 47, 3)], [19, 14, 9]
    ref_logits, ref, ref_forwards, _ = decode(seam, "eager", batch, budgets, 4)
    got_logits, got, forwards, runner = decode(seam, "compiled", batch, budgets, 4)
    assert got == ref and forwards == ref_forwards
    same_logits(got_logits, ref_logits)
    assert runner.eager_calls == 0
    assert {k.span for k in state_of(seam).replays} == {64, 128}


@pytest.mark.timeout(1800)
def test_masked_head_steps_decode_as_eager(tmp_path):
    """LLaDA2 (no shift) in blocks of 16: its greedy steps ask for their head, and the compiled ones
    with at most 8 masked columns per row run the last layer and the head on 8 columns
    (`FamilySeam.head_width`, a graph of their own) and return those columns' logits alone
    (`head_columns`, which the mode reads); the same tokens and forwards as the eager runner, its
    logits at the columns the graph computed."""
    from clover.models.family_seam import head_columns

    write_family(tmp_path, "llada2_moe")
    seam = FamilySeam(confident(tmp_path, "llada2_moe", 3.0))  # unsure enough to fill a block in several steps
    batch, budgets = prompts(), [20, 13, 27]
    with runner_windows("compiled") as windows:
        ref_logits, ref, ref_forwards, _ = decode(seam, "eager", batch, budgets, 16)
        got_logits, got, forwards, runner = decode(seam, "compiled", batch, budgets, 16)
    assert got == ref and forwards == ref_forwards
    assert runner.eager_calls == 0
    assert {k.head for k in state_of(seam).replays} == {0, 8}
    trimmed, mask_id = 0, seam.config.mask_token_id
    for (a, _), (b, index), ids in zip(got_logits, ref_logits, windows, strict=True):
        if a.shape[1] < 16:  # a masked-head step: the logits of each row's `head_columns` alone
            window = ids[:, -16:]
            cols = head_columns(window, mask_id, a.shape[1], shift=False, sub_block=0)
            known = torch.ones(16, dtype=torch.bool)  # the columns the eager head computed (`logits_index`)
            if index is not None:
                b, known = b.new_zeros(len(b), 16, b.shape[-1]).index_copy_(1, index, b), ~known.index_fill(0, index, 0)
            read = (window.gather(1, cols) == mask_id) & known[cols]  # the masked ones: what the step reads
            assert bool(read.any()) and bool((window == mask_id).sum(1).le(a.shape[1]).all())
            a, b, trimmed = a[read], b.gather(1, cols[:, :, None].expand(-1, -1, b.shape[-1]))[read], trimmed + 1
        elif index is not None:  # the eager head: some rows' columns
            a = a[:, index]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=3.0 * 1e-5)
    assert trimmed > 0


@contextlib.contextmanager
def runner_windows(runner: str):
    """While inside: the ids of every forward of the compiled runner class, in order."""
    from clover.engine.runner import CompiledRunner

    ids, real = [], CompiledRunner.forward

    def record(self, window, cache, **kw):
        ids.append(window.clone())
        return real(self, window, cache, **kw)

    CompiledRunner.forward = record
    try:
        yield ids
    finally:
        CompiledRunner.forward = real
