"""A compiled family step that computes only the columns whose logits a mode reads (`select`: the
last layer's queries, MLP and the head on those columns alone; modeling_family.static_forward)
against the same step computing every column: the same logits at those columns and the same
committed K/V, for a batch of rows of odd, different lengths (left padding), eagerly (the graphs run
this code). And Fast-dLLM v2's sub-block choice (family_seam.sub_block_columns) against the columns
`engine.modes.advance` reads, written naively: its logits there equal the full step's."""

from __future__ import annotations

import pytest
import torch
from test_families import VOCAB, confident, write_family
from test_family_span import LENGTHS, committed, step_inputs

from clover.models.family_seam import FamilySeam, sub_block_columns


@pytest.mark.parametrize("model_type", ["sdar", "sdar_moe", "llada2_moe", "Fast_dLLM_Qwen"])
def test_selected_columns_equal_the_full_step(tmp_path, model_type):
    model, g, ids, pad = step_inputs(tmp_path, model_type, 2)
    cols = torch.stack([torch.randperm(9, generator=g)[:3] for _ in LENGTHS])  # any columns, any order
    with torch.no_grad():
        full_cache, cache = committed(model, LENGTHS), committed(model, LENGTHS)
        full = model.static_forward(ids, full_cache, 4, pad)
        got = model.static_forward(ids, cache, 4, pad, select=cols)
    assert got.shape == (len(LENGTHS), 3, full.shape[-1])
    torch.testing.assert_close(got, full.gather(1, cols[:, :, None].expand(-1, -1, full.shape[-1])),
                               rtol=1e-5, atol=3e-4)
    for layer in full_cache.key:  # every column's K/V written, the scratch slots included
        torch.testing.assert_close(cache.key[layer], full_cache.key[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.value[layer], full_cache.value[layer], rtol=1e-5, atol=1e-5)


def read_columns(window: torch.Tensor, mask_id: int, sub: int) -> list[set[int]]:
    """Per row, the columns whose logits `advance` reads in a shifted window: target j (column j + 1,
    never the last) is masked where that column holds the mask; only the first sub-block (group
    (j + 1) // sub) with a masked target is filled, from the logits at column j."""
    out = []
    for row in window.tolist():
        masked = [j for j in range(len(row) - 1) if row[j + 1] == mask_id]
        first = min(((j + 1) // sub for j in masked), default=None)
        out.append({j for j in masked if (j + 1) // sub == first})
    return out


def random_windows(g, rows: int, width: int, mask_id: int) -> torch.Tensor:
    """Windows as a sub-block step leaves them: a known first column, filled tokens and masks mixed."""
    window = torch.randint(4, VOCAB - 1, (rows, width), generator=g)
    masked = torch.rand(rows, width, generator=g) < torch.rand(rows, 1, generator=g)
    masked[:, 0] = False
    masked[0] = False  # a finished window
    masked[1, 1:] = True  # a fresh one
    masked[2, 1:9] = False  # the first sub-block done
    return torch.where(masked, mask_id, window)


@pytest.mark.parametrize("width,sub", [(32, 8), (12, 4), (9, 3)])
def test_sub_block_columns_hold_every_column_advance_reads(width, sub):
    g = torch.Generator().manual_seed(width)
    mask_id = VOCAB - 1
    window = random_windows(g, 24, width, mask_id)
    cols = sub_block_columns(window, mask_id, sub)
    assert cols.shape == (24, sub)
    for r, need in enumerate(read_columns(window, mask_id, sub)):
        have = cols[r].tolist()
        assert need <= set(have) and len(set(have)) == sub and min(have) >= 0 and max(have) < width, (r, need, have)


def test_fast_dllm_graph_step_reads_the_full_logits(tmp_path):
    """The seam's draft step of a sub-block family (`sub_block_head` on), compiled layout and eager:
    at the columns advance reads, the full step's logits; the cache as the full step leaves it."""
    write_family(tmp_path, "Fast_dLLM_Qwen")
    loaded = confident(tmp_path, "Fast_dLLM_Qwen")
    seam = FamilySeam(loaded)
    assert seam.sub_block == 8 and not seam.trims(32, 32, 32)  # off unless asked
    seam.sub_block_head = True
    assert seam.trims(32, 32, 32) and not seam.trims(64, 32, 33) and not seam.trims(8, 8, 8)
    mask_id = seam.config.mask_token_id
    g = torch.Generator().manual_seed(3)
    window = random_windows(g, len(LENGTHS), 32, mask_id)
    with torch.no_grad():
        full_cache, cache = committed(loaded.model, LENGTHS), committed(loaded.model, LENGTHS)
        full = loaded.model.static_forward(window, full_cache, 32, None, 32)
        got = seam.graph_step(window, None, cache, 32, 32, 32, 32)
        eager_ref = loaded.model(window, cache=committed(loaded.model, LENGTHS), block_size=32)
        eager = seam(window, cache=committed(loaded.model, LENGTHS), block_size=32, draft_len=32,
                     logits_to_keep=32).logits
    assert got.shape == full.shape == eager.shape
    for r, need in enumerate(read_columns(window, mask_id, 8)):
        for j in need:
            torch.testing.assert_close(got[r, j], full[r, j], rtol=1e-5, atol=3e-4)
            torch.testing.assert_close(eager[r, j], eager_ref[r, j], rtol=1e-5, atol=3e-4)
    for layer in full_cache.key:
        torch.testing.assert_close(cache.key[layer], full_cache.key[layer], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["sdar_moe", "llada2_moe", "Fast_dLLM_Qwen"])
@pytest.mark.parametrize("keep", [1, 4])
def test_kept_columns_equal_the_full_step(tmp_path, model_type, keep):
    """`keep` < the step's columns (a commit with its draft, a prefill chunk): the last layer and the
    head run on the kept columns only, eagerly and in the compiled layout; the same logits and K/V."""
    from clover.models.modeling_family import tail_columns

    write_family(tmp_path, model_type)
    loaded = confident(tmp_path, model_type)
    model, seam = loaded.model, FamilySeam(loaded)
    ids = torch.randint(4, VOCAB, (len(LENGTHS), 9), generator=torch.Generator().manual_seed(4))
    assert tail_columns(ids, 9) is None and tail_columns(ids, 0) is None
    with torch.no_grad():
        full_cache, cache = committed(model, LENGTHS), committed(model, LENGTHS)
        full = model.static_forward(ids, full_cache, 4)[:, -keep:]
        got = model.static_forward(ids, cache, 4, keep=keep)
        eager_cache = committed(model, LENGTHS)
        eager = seam(ids, cache=eager_cache, block_size=4, draft_len=4, logits_to_keep=keep).logits
        eager_ref = model(ids, cache=committed(model, LENGTHS), commit=5, block_size=4)[:, -keep:]
    torch.testing.assert_close(got, full, rtol=1e-5, atol=3e-4)
    torch.testing.assert_close(eager, eager_ref, rtol=1e-5, atol=3e-4)
    assert eager_cache.lens.tolist() == [n + 5 for n in LENGTHS]
    for layer in full_cache.key:
        torch.testing.assert_close(cache.key[layer], full_cache.key[layer], rtol=1e-5, atol=1e-5)


def test_sub_block_steps_ask_for_their_head(tmp_path):
    """The engine's greedy sub-block steps ask for the sub-block head (`Forward.sub_block_head`), so
    the compiled runner makes their graphs apart (`ShapeKey.sub_block_head`); a family without
    sub-blocks never asks, and neither does a call of the same shape that does not ask (the seam's
    head then covers every kept column)."""
    from clover.compile import state_of
    from clover.engine import DecodeConfig, Engine

    write_family(tmp_path, "Fast_dLLM_Qwen")
    seam = FamilySeam(confident(tmp_path, "Fast_dLLM_Qwen"))
    seam.sub_block = 2
    engine = Engine(seam, DecodeConfig(block_size=4, threshold=0.6, max_new_tokens=8, runner="compiled"))
    engine.generate([[5, 6, 7, 8, 9]])
    keys = [k for k in state_of(seam).replays]
    assert any(k.sub_block_head for k in keys) and not all(k.sub_block_head for k in keys)
    assert not any(k.sub_block_head and k.draft_len != k.shape[1] for k in keys)
    window = torch.full((1, 4), seam.config.mask_token_id)
    window[0, 0] = 5
    with torch.no_grad():
        plain = seam(window, cache=committed(seam.family_model, (4,)), block_size=4, draft_len=4, logits_to_keep=4)
    assert bool((plain.logits != 0).all())


def test_asked_sub_block_step_returns_its_columns_alone(tmp_path):
    """A sub-block step that asks (`sub_block_head=True`, as the engine's greedy steps do) gets the
    logits of its `sub_block_columns` alone, [rows, 8, V], compiled layout and eager: the full step's
    logits at those columns, for rows of odd, different lengths; the cache as the full step leaves it."""
    write_family(tmp_path, "Fast_dLLM_Qwen")
    loaded = confident(tmp_path, "Fast_dLLM_Qwen")
    seam = FamilySeam(loaded)
    mask_id = seam.config.mask_token_id
    window = random_windows(torch.Generator().manual_seed(5), len(LENGTHS), 32, mask_id)
    cols = sub_block_columns(window, mask_id, 8)
    with torch.no_grad():
        full_cache, cache = committed(loaded.model, LENGTHS), committed(loaded.model, LENGTHS)
        full = loaded.model.static_forward(window, full_cache, 32, None, 32)
        got = seam.graph_step(window, None, cache, 32, 32, 32, 32, sub_block_head=True)
        eager_ref = loaded.model(window, cache=committed(loaded.model, LENGTHS), block_size=32)
        eager = seam(window, cache=committed(loaded.model, LENGTHS), block_size=32, draft_len=32, logits_to_keep=32,
                     sub_block_head=True).logits
    index = cols[:, :, None].expand(-1, -1, full.shape[-1])
    assert got.shape == eager.shape == (len(LENGTHS), 8, full.shape[-1])
    torch.testing.assert_close(got, full.gather(1, index), rtol=1e-5, atol=3e-4)
    torch.testing.assert_close(eager, eager_ref.gather(1, index), rtol=1e-5, atol=3e-4)
    for layer in full_cache.key:
        torch.testing.assert_close(cache.key[layer], full_cache.key[layer], rtol=1e-5, atol=1e-5)


def test_sub_block_pick_equals_the_pick_over_every_column():
    """engine.modes.pick_sub_block_and_advance (the logits of each row's sub-block columns alone) gives
    the state, window and finished rows of pick_and_advance over every column's logits (the other
    columns' logits anything), on random windows, block states and logits."""
    from clover.engine.modes import BlockState, pick_and_advance, pick_sub_block_and_advance
    from clover.engine.policies import make_policy

    g = torch.Generator().manual_seed(6)
    rows, width, sub, mask_id = 24, 32, 8, VOCAB - 1
    window = random_windows(g, rows, width, mask_id)
    filled = torch.cat([window[:, 1:] != mask_id, torch.zeros(rows, 1, dtype=torch.bool)], dim=1)
    eligible = torch.arange(width)[None] < torch.randint(width - 6, width, (rows, 1), generator=g)
    state = BlockState(filled, torch.randint(4, VOCAB, (rows, width), generator=g), torch.zeros(rows, width).long(),
                       torch.randint(0, 5, (rows,), generator=g), eligible)
    logits = torch.randn(rows, width, VOCAB, generator=g) * 4
    cols = sub_block_columns(window, mask_id, sub)
    policy, banned, eos = make_policy("low_confidence", width, 0.5), torch.tensor([mask_id]), torch.tensor([3])
    want = pick_and_advance(policy, logits, banned, *state.fields(), window, eos, shift=True, sub_block=sub)
    got = pick_sub_block_and_advance(policy, mask_id, logits.gather(1, cols[:, :, None].expand(-1, -1, VOCAB)),
                                     banned, *state.fields(), window, eos, shift=True, sub_block=sub)
    assert not torch.equal(want[0], filled) and not torch.equal(want[-2], window)  # some targets filled
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("model_type", ["sdar", "llada2_moe"])
def test_masked_head_step_equals_the_full_step(tmp_path, model_type):
    """A family without shift, a step that asks for its head (`sub_block_head`, as the engine's
    greedy steps do): `head_width` columns hold every row's masked ones, and the seam's compiled-layout
    step computing the last layer and the head on those (`masked_columns`) returns the full step's
    logits at those columns alone (the columns `head_columns` names, as the mode reads them), and
    leaves the cache as the full step does; rows
    of odd, different lengths, windows masked anywhere. The eager seam ignores the ask (its
    `logits_index` chooses the columns)."""
    from clover.models.family_seam import HEAD_MIN, head_columns, masked_columns

    write_family(tmp_path, model_type)
    loaded = confident(tmp_path, model_type)
    seam = FamilySeam(loaded)
    mask_id = seam.config.mask_token_id
    g = torch.Generator().manual_seed(7)
    window = random_windows(g, len(LENGTHS), 32, mask_id)
    window[1, 9:] = torch.randint(4, VOCAB - 1, (23,), generator=g)  # 8 masks at most in any row
    window[2, 5:] = 7
    assert seam.head_width(window, 32, 32) == HEAD_MIN
    assert seam.head_width(window, 0, 32) == HEAD_MIN and seam.head_width(window, 32, 0) == 0
    window[1, 3:16] = mask_id  # 13 masks in a row
    head = seam.head_width(window, 32, 32)
    assert head == 16
    window[0, 1:] = mask_id
    assert seam.head_width(window, 32, 32) == 0  # all the window's columns: no narrower graph
    window[0, 1:] = 5
    masked = window == mask_id
    cols = masked_columns(window, mask_id, 32, head)
    assert all(set(masked[r].nonzero().squeeze(1).tolist()) <= set(cols[r].tolist()) for r in range(len(LENGTHS)))
    with torch.no_grad():
        full_cache, cache = committed(loaded.model, LENGTHS), committed(loaded.model, LENGTHS)
        full = loaded.model.static_forward(window, full_cache, 32, None, 32)
        got = seam.graph_step(window, None, cache, 32, 32, 32, 32, sub_block_head=True, head=head)
        index = torch.tensor([3, 17])
        eager = seam(window, cache=committed(loaded.model, LENGTHS), block_size=32, draft_len=32, logits_to_keep=32,
                     logits_index=index, sub_block_head=True).logits
        eager_ref = loaded.model(window, cache=committed(loaded.model, LENGTHS), block_size=32)
    chosen = torch.zeros_like(masked).scatter(1, cols, True)
    assert got.shape == (len(LENGTHS), head, full.shape[-1]) and bool((masked <= chosen).all())
    assert torch.equal(head_columns(window, mask_id, head, shift=False, sub_block=0), cols)
    torch.testing.assert_close(got, full.gather(1, cols[:, :, None].expand(-1, -1, full.shape[-1])),
                               rtol=1e-5, atol=3e-4)
    torch.testing.assert_close(eager, eager_ref[:, index], rtol=1e-5, atol=3e-4)
    for layer in full_cache.key:
        torch.testing.assert_close(cache.key[layer], full_cache.key[layer], rtol=1e-5, atol=1e-5)


def test_masked_head_needs_a_family_without_shift(tmp_path):
    write_family(tmp_path, "Fast_dLLM_Qwen")
    seam = FamilySeam(confident(tmp_path, "Fast_dLLM_Qwen"))
    window = torch.full((2, 32), 5)
    window[:, 20:] = seam.config.mask_token_id
    assert seam.head_width(window, 32, 32) == 0
