"""Every fast op against its naive reference: random inputs, odd lengths, batch 2."""

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clover.models.modeling_clover import window_ids
from clover.ops.block_attention import local_window_attention, masked_attention, naive_masked_attention
from clover.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_from_states,
    fused_recurrent_gated_delta_rule,
    gated_delta_rule,
    naive_gated_delta_rule,
)
from clover.ops.moe import gathered_experts, grouped_experts, naive_experts
from clover.ops.short_conv import block_short_conv, naive_block_short_conv


def gdn_inputs(batch, length, heads=3, dk=8, dv=6):
    q = F.normalize(torch.randn(batch, length, heads, dk), dim=-1)
    k = F.normalize(torch.randn(batch, length, heads, dk), dim=-1)
    v = torch.randn(batch, length, heads, dv)
    g = -F.softplus(torch.randn(batch, length, heads))
    beta = torch.rand(batch, length, heads)
    state = torch.randn(batch, heads, dk, dv)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("length", [1, 2, 7, 13, 33])
@pytest.mark.parametrize("with_state", [False, True])
def test_gated_delta_rule_forms_match_naive(length, with_state):
    q, k, v, g, beta, state = gdn_inputs(2, length)
    init = state if with_state else None
    ref_out, ref_state = naive_gated_delta_rule(q, k, v, g, beta, 0.4, init)
    out, st = fused_recurrent_gated_delta_rule(q, k, v, g, beta, 0.4, init)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st, ref_state, atol=1e-5, rtol=1e-5)
    for chunk in (1, 4, 5, 64):
        out, st, _ = chunk_gated_delta_rule(q, k, v, g, beta, 0.4, init, chunk_size=chunk)
        torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(st, ref_state, atol=1e-4, rtol=1e-4)
    out, st = gated_delta_rule(q, k, v, g, beta, 0.4, init)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st, ref_state, atol=1e-4, rtol=1e-4)
    # a draft window's form: the output only (one chunk read from the initial state)
    out, st = gated_delta_rule(q, k, v, g, beta, 0.4, init, output_final_state=False)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    assert st is None


def test_chunk_states_are_the_states_at_left_anchored_boundaries():
    q, k, v, g, beta, state = gdn_inputs(2, 11)
    _, _, starts = chunk_gated_delta_rule(q, k, v, g, beta, 0.5, state, chunk_size=4)
    # chunks anchored at the end: [0,3) [3,7) [7,11)
    for i, begin in enumerate((0, 3, 7)):
        _, expect = naive_gated_delta_rule(q[:, :begin], k[:, :begin], v[:, :begin], g[:, :begin], beta[:, :begin], 0.5, state)
        torch.testing.assert_close(starts[:, :, i], expect, atol=1e-4, rtol=1e-4)


def test_chunk_from_states_runs_each_chunk_from_its_own_state():
    q, k, v, g, beta, _ = gdn_inputs(2, 10)
    starts = torch.randn(2, 3, 3, 8, 6)  # 3 chunks of 4 anchored at the end: [0,2) [2,6) [6,10)
    out = chunk_gated_delta_rule_from_states(q, k, v, g, beta, 0.5, starts, 4)
    for i, (s, e) in enumerate(((0, 2), (2, 6), (6, 10))):
        ref, _ = naive_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], 0.5, starts[:, :, i])
        torch.testing.assert_close(out[:, s:e], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lq,lk", [(1, 1), (5, 9), (7, 7)])
def test_masked_attention_matches_naive(lq, lk):
    q = torch.randn(2, 4, lq, 8)
    k, v = torch.randn(2, 2, lk, 8), torch.randn(2, 2, lk, 5)
    mask = torch.rand(2, 1, lq, lk) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    torch.testing.assert_close(masked_attention(q, k, v, mask, 0.3), naive_masked_attention(q, k, v, mask, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length,window,padded,compiled", [(1, 1, False, False), (9, 4, True, False), (13, 4, False, False),
                                                            (8, 8, True, False), (11, 3, True, False), (13, 4, True, True),
                                                            (21, 16, True, True)])
def test_local_window_attention_matches_naive_same_window_mask(length, window, padded, compiled):
    """Per-window attention equals the dense masked one (the stream layout's same-window mask: windows
    anchored at the end, keys only real columns, a padded query on itself) on random inputs; compiled,
    small windows take the product-sum form, wide ones the matmuls."""
    q, k, v = torch.randn(2, length, 3, 8), torch.randn(2, length, 3, 8), torch.randn(2, length, 3, 5)
    valid = torch.ones(2, length, dtype=torch.bool)
    if padded:
        valid[0, : length // 2 + 1] = False
    wid = window_ids(length, window)
    mask = (wid[None, :] == wid[:, None])[None] & valid[:, None, :]
    mask = (mask | (torch.eye(length, dtype=torch.bool)[None] & ~valid[:, :, None]))[:, None]
    ref = naive_masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, 1.0).transpose(1, 2)
    fn = torch.compile(local_window_attention, fullgraph=True, dynamic=False) if compiled else local_window_attention
    out = fn(q, k, v, valid if padded else None, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 37])
@pytest.mark.parametrize("hidden,inter", [(10, 7), (16, 8)])  # 16/8: aligned rows take torch's grouped GEMM
@pytest.mark.parametrize("grad", [False, True])
def test_grouped_experts_match_naive(tokens, hidden, inter, grad):
    experts, topk = 6, 2
    x = torch.randn(tokens, hidden)
    gate_up, down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    top_w, top_idx = torch.softmax(torch.randn(tokens, experts), -1).topk(topk, dim=-1)
    leaves = [t.requires_grad_(grad) for t in (x, gate_up, down, top_w)]
    with torch.set_grad_enabled(grad):
        fast = grouped_experts(x, top_idx, top_w, gate_up, down)
    twins = [t.detach().clone().requires_grad_(grad) for t in leaves]
    with torch.set_grad_enabled(grad):
        ref = naive_experts(twins[0], top_idx, twins[3], twins[1], twins[2])
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)
    if grad:  # every gradient (input, both expert weights, routing weights) as the naive loop's
        g = torch.randn_like(ref)
        (fast * g).sum().backward()
        (ref * g).sum().backward()
        for a, b in zip(leaves, twins):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("length,block", [(1, 1), (2, 32), (9, 4), (13, 5), (6, 32), (131, 16), (3, 2)])  # 131: the conv1d path
@pytest.mark.parametrize("right", [True, False])
def test_block_short_conv_matches_naive(length, block, right):
    channels, kernel = 5, 4
    x_ext = torch.randn(2, channels, kernel - 1 + length)
    weight = torch.randn(channels, kernel)
    right_w = torch.randn(channels, kernel - 1) if right else torch.zeros(channels, kernel - 1)
    pad = (-length) % block
    wid = (torch.arange(length) + pad) // block
    fast = block_short_conv(x_ext, weight, right_w if right else None, wid)
    torch.testing.assert_close(fast, naive_block_short_conv(x_ext, weight, right_w, wid), atol=1e-5, rtol=1e-5)


def test_chunk_form_trains_after_running_under_inference_mode():
    """The chunk masks are cached: built while decoding (inference mode), they must still serve a
    later training step's backward in the same process."""
    q, k, v, g, beta, state = gdn_inputs(1, 23)  # a chunk size no other test uses
    with torch.inference_mode():
        chunk_gated_delta_rule(q, k, v, g, beta, 0.4, state, chunk_size=23)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    out, _, _ = chunk_gated_delta_rule(*leaves, 0.4, state, chunk_size=23)
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("tokens", [1, 2, 5, 17, 21, 63])  # up to GATHER_PAIRS pairs: a compiled draft window's experts
def test_gathered_experts_match_naive(tokens):
    experts, topk, hidden, inter = 16, 3, 10, 7
    torch.manual_seed(tokens)
    x = torch.randn(tokens, hidden)
    gate_up, down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    top_w, top_idx = torch.softmax(torch.randn(tokens, experts), -1).topk(topk, dim=-1)
    torch.testing.assert_close(gathered_experts(x, top_idx, top_w, gate_up, down),
                               naive_experts(x, top_idx, top_w, gate_up, down), atol=1e-4, rtol=1e-4)


def test_gathered_experts_compiled_match_naive():
    """The compiled form (inductor fuses the weight gather into the products) on an odd window."""
    experts, topk, hidden, inter, tokens = 8, 2, 24, 12, 13
    torch.manual_seed(3)
    x = torch.randn(tokens, hidden)
    gate_up, down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    top_w, top_idx = torch.softmax(torch.randn(tokens, experts), -1).topk(topk, dim=-1)
    with torch.inference_mode():
        got = torch.compile(gathered_experts, dynamic=False)(x, top_idx, top_w, gate_up, down)
    torch.testing.assert_close(got, naive_experts(x, top_idx, top_w, gate_up, down), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens, tiled_pairs", [(1, 4), (1, 1), (3, 4), (70, 200)])
def test_expert_dispatch_matches_naive_eagerly_and_traced(tokens, tiled_pairs):
    """`ops.moe.experts`, the one dispatch: eagerly the grouped form, traced (dynamo) the tiled op,
    the gathered products or the opaque grouped op by pair count; every choice equals the spec."""
    from clover.ops.linear import tiled
    from clover.ops.moe import experts as dispatch

    tiled.available()  # built before tracing, as a compiled runner does (tiled or not, the results are equal)
    n_experts, topk, hidden, inter = 6, 2, 16, 8
    torch.manual_seed(tokens)
    x = torch.randn(tokens, hidden)
    gate_up, down = torch.randn(n_experts, 2 * inter, hidden) * 0.3, torch.randn(n_experts, hidden, inter) * 0.3
    top_w, top_idx = torch.softmax(torch.randn(tokens, n_experts), -1).topk(topk, dim=-1)
    want = naive_experts(x, top_idx, top_w, gate_up, down)
    with torch.inference_mode():
        eager = dispatch(x, top_idx, top_w, gate_up, down, tiled_pairs)
        traced = torch.compile(dispatch, backend="eager", fullgraph=True, dynamic=False)(
            x, top_idx, top_w, gate_up, down, tiled_pairs)
    torch.testing.assert_close(eager, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(traced, want, atol=1e-5, rtol=1e-5)


def _tiled():
    from clover.ops.linear import tiled

    if not tiled.available():
        pytest.skip("the tiled linear cannot be built here (no C++ compiler or not x86-64)")
    return tiled


# where the tiled kernels keep bf16 panels: their AVX-512 and AVX2 tiles widen them (the plain C++ does not)
BF16_PANELS = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


# one and two rows (an AR step's shapes) with K of 6, 13 and 30: odd k-pair counts and an unpaired last k
@pytest.mark.parametrize("shape", [(1, 1, 256), (1, 1, 6), (2, 1, 13), (1, 1, 30), (2, 9, 256), (3, 17, 128),
                                   (1, 33, 200), (2, 70, 7)])
@pytest.mark.parametrize("out", [777, 16, 5])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("bf16_values", [False, True])
def test_tiled_linear_matches_naive(shape, out, with_bias, bf16_values):
    """fp32 weights, and fp32 weights holding bf16 values (a bf16 checkpoint loaded as fp32), which
    the op packs as bf16 panels: half the bytes, widened exactly."""
    from clover.ops.linear import naive_linear

    tiled = _tiled()
    torch.manual_seed(0)
    x, w = torch.randn(*shape), torch.randn(out, shape[-1]) / shape[-1] ** 0.5
    if bf16_values:
        w = w.bfloat16().float()
    b = torch.randn(out) if with_bias else None
    torch.testing.assert_close(tiled.tiled_linear(x, w, b), naive_linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert tiled.bf16_panels(w) == (bf16_values and BF16_PANELS)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 10, 11, 16, 17, 21, 24, 40, 64])
@pytest.mark.parametrize("in_features,out", [(64, 777), (256, 16), (96, 5), (224, 40)])
@pytest.mark.parametrize("amx", [True, False])
def test_bf16_panels_on_amx_and_avx512_match_naive(rows, in_features, out, amx):
    """bf16-valued weights from 6 rows run on AMX tiles where the CPU has them (x split into three
    bf16 terms: fp32 accuracy), else on the AVX-512 or AVX2 tiles; both against the naive linear, batch 2."""
    from clover.ops.linear import naive_linear

    tiled = _tiled()
    torch.manual_seed(rows)
    x = torch.randn(2, rows, in_features) * torch.logspace(-3, 3, in_features)  # wide range: the split must hold
    w = (torch.randn(out, in_features) / in_features**0.5).bfloat16().float()
    b = torch.randn(out)
    was = tiled.use_amx(amx)
    try:
        y = tiled.tiled_linear(x, w, b)
    finally:
        tiled.use_amx(True)
    torch.testing.assert_close(y, naive_linear(x, w, b), rtol=1e-5, atol=1e-5 * x.abs().max().item())
    # fp32 accuracy: the error within a few fp32 roundings of the sum of |products| (fp64 reference)
    ref = x.double() @ w.double().T + b.double()
    assert ((y.double() - ref).abs() <= 1e-6 * (x.double().abs() @ w.double().abs().T + b.double().abs())).all()
    assert not was or "amx_bf16" in Path("/proc/cpuinfo").read_text()


@contextlib.contextmanager
def bf16_activations():
    """The tiled kernels' bf16 activations (`--linear-dtype bfloat16`) for the block, off after."""
    from clover.ops.linear import tiled

    was = tiled.use_bf16_activations(True)
    try:
        yield
    finally:
        tiled.use_bf16_activations(was)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 11, 17, 40])
@pytest.mark.parametrize("in_features,out", [(64, 777), (256, 16), (13, 40), (30, 5), (224, 40)])
@pytest.mark.parametrize("amx", [True, False])
def test_bf16_activations_match_the_rounded_reference(rows, in_features, out, amx):
    """bf16 activations: bf16 panels take x rounded to bf16 (AVX512-BF16, and one AMX term from 6 rows
    where K is a multiple of 32): within fp32 roundings of an fp64 product of the rounded x, batch 2,
    odd K. A CPU without bf16 products keeps the exact kernel. Exact again once turned off."""
    from clover.ops.linear import naive_linear

    tiled = _tiled()
    torch.manual_seed(rows + in_features)
    x = torch.randn(2, rows, in_features) * torch.logspace(-3, 3, in_features)
    w = (torch.randn(out, in_features) / in_features**0.5).bfloat16().float()
    b = torch.randn(out)
    was = tiled.use_amx(amx)
    try:
        with bf16_activations():
            y = tiled.tiled_linear(x, w, b)
        exact = tiled.tiled_linear(x, w, b)
    finally:
        tiled.use_amx(True)
    torch.testing.assert_close(exact, naive_linear(x, w, b), rtol=1e-5, atol=1e-5 * x.abs().max().item())
    if not (tiled.bf16_dot() and tiled.bf16_panels(w)):
        torch.testing.assert_close(y, exact, rtol=0, atol=0)
        return
    xr = x.bfloat16().double()
    ref = xr @ w.double().T + b.double()
    assert ((y.double() - ref).abs() <= 1e-6 * (xr.abs() @ w.double().abs().T + b.double().abs())).all()
    assert (y - exact).abs().max() > 0  # x was rounded: the medium path ran


def test_tiled_experts_with_bf16_activations():
    """The experts op takes bf16 activations too: both projections on bf16-rounded inputs (bf16-level
    agreement with the naive experts, and not the exact op's numbers)."""
    from clover.ops.moe import naive_experts

    tiled = _tiled()
    torch.manual_seed(2)
    tokens, experts, topk, hidden, inter = 9, 8, 2, 256, 128
    x = torch.randn(tokens, hidden)
    gate_up = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).bfloat16().float()
    down = (torch.randn(experts, hidden, inter) / inter**0.5).bfloat16().float()
    top_w, top_idx = torch.softmax(torch.randn(tokens, experts), -1).topk(topk, dim=-1)
    want = naive_experts(x, top_idx, top_w, gate_up, down)
    exact = tiled.tiled_experts(x, top_idx, top_w, gate_up, down)
    with bf16_activations():
        got = tiled.tiled_experts(x, top_idx, top_w, gate_up, down)
    torch.testing.assert_close(exact, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    if tiled.bf16_dot() and tiled.bf16_panels(down):
        assert (got - exact).abs().max() > 0


@pytest.mark.parametrize("rows,k,out", [(1, 77, 333), (5, 256, 96), (9, 13, 1000)])
@pytest.mark.parametrize("bf16_values", [False, True])
def test_tiled_linear_gives_the_same_numbers_on_one_and_two_threads(rows, k, out, bf16_values):
    """Split over two threads (every call, whatever its size) the op's numbers are those of one thread
    bit for bit, and the naive linear's to rounding: odd sizes, batch 2."""
    from helpers import split_over_threads

    from clover.ops.linear import naive_linear

    tiled = _tiled()
    torch.manual_seed(rows + k)
    x, w, b = torch.randn(2, rows, k), torch.randn(out, k) / k**0.5, torch.randn(out)
    w = w.bfloat16().float() if bf16_values else w
    one = tiled.tiled_linear(x, w, b)
    with split_over_threads(2):
        two = tiled.tiled_linear(x, w, b)
    assert torch.equal(one, two)
    torch.testing.assert_close(two, naive_linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 7])
def test_tiled_experts_give_the_same_numbers_on_one_and_two_threads(tokens):
    from helpers import split_over_threads

    tiled = _tiled()
    torch.manual_seed(tokens)
    n_experts, topk, hidden, inter = 5, 2, 40, 24
    x = torch.randn(tokens, hidden)
    gate_up, down = torch.randn(n_experts, 2 * inter, hidden) * 0.2, torch.randn(n_experts, hidden, inter) * 0.2
    top_w, top_idx = torch.softmax(torch.randn(tokens, n_experts), -1).topk(topk, dim=-1)
    one = tiled.tiled_experts(x, top_idx, top_w, gate_up, down)
    with split_over_threads(2):
        two = tiled.tiled_experts(x, top_idx, top_w, gate_up, down)
    assert torch.equal(one, two)
    torch.testing.assert_close(two, naive_experts(x, top_idx, top_w, gate_up, down), atol=1e-5, rtol=1e-5)


def test_tiled_linear_keeps_fp32_panels_unless_every_value_is_bf16():
    from clover.ops.linear import naive_linear

    tiled = _tiled()
    torch.manual_seed(0)
    x, w = torch.randn(3, 64), torch.randn(40, 64).bfloat16().float()
    w[7, 5] += 2**-20  # one value bf16 cannot hold: the panels must stay fp32 (lossless or nothing)
    assert not tiled.bf16_panels(w)
    torch.testing.assert_close(tiled.tiled_linear(x, w), naive_linear(x, w), rtol=1e-5, atol=1e-5)


def test_tiled_linear_repacks_after_an_in_place_update_and_forgets_freed_weights():
    from clover.ops.linear import naive_linear

    tiled = _tiled()
    torch.manual_seed(0)
    x, w = torch.randn(2, 9, 64), torch.randn(96, 64)
    tiled.tiled_linear(x, w)
    with torch.no_grad():
        w.mul_(-2)  # an optimizer step or load_state_dict writes the same tensor
    torch.testing.assert_close(tiled.tiled_linear(x, w), naive_linear(x, w), rtol=1e-5, atol=1e-5)
    live = tiled.cached_weights()
    del w
    assert tiled.cached_weights() == live - 1
    w2 = torch.randn(96, 64)  # may reuse the freed weight's memory: must not get its packed copy
    torch.testing.assert_close(tiled.tiled_linear(x, w2), naive_linear(x, w2), rtol=1e-5, atol=1e-5)


def test_tiled_linear_takes_weights_made_under_inference_mode():
    from clover.ops.linear import naive_linear

    tiled = _tiled()
    with torch.inference_mode():  # such a weight has no version counter to watch: it must still be right
        x, w = torch.randn(2, 9, 64), torch.randn(96, 64)
        torch.testing.assert_close(tiled.tiled_linear(x, w), naive_linear(x, w), rtol=1e-5, atol=1e-5)
        w.mul_(-2)
        torch.testing.assert_close(tiled.tiled_linear(x, w), naive_linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 9])
def test_compiled_graphs_route_linears_to_the_tiled_op(rows):
    from clover.compile import route_linears

    _tiled()
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 1024, bias=False)
    counts = []

    def backend(gm, example_inputs):
        counts.append(route_linears(gm))
        return gm.forward

    x = torch.randn(1, rows, 256)
    with torch.no_grad():
        out = torch.compile(lambda t: torch.relu(lin(t)), backend=backend, fullgraph=True, dynamic=False)(x)
        torch.testing.assert_close(out, torch.relu(lin(x)), rtol=1e-5, atol=1e-5)
    assert counts == [1]


@pytest.mark.parametrize("batch,size,width", [((1, 4, 1), 8, 128), ((2, 3, 5), 7, 33), ((2,), 64, 128), ((3,), 1, 5)])
def test_unit_lower_solve_matches_torch(batch, size, width):
    """The gated delta rule's chunk solve, forward substitution in C++, against torch's trsm: only
    the strict lower part of the system is read (garbage on and above the diagonal)."""
    tiled = _tiled()
    g = torch.Generator().manual_seed(size)
    lower = torch.randn(*batch, size, size, generator=g) * 0.3
    system = lower.tril(-1) + torch.eye(size)
    rhs = torch.randn(*batch, size, width, generator=g)
    ref = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    garbage = lower + torch.randn(*batch, size, size, generator=g).triu() * 100  # diagonal and upper unread
    got = tiled.unit_lower_solve(garbage, rhs)
    assert got.shape == ref.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(system @ got, rhs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch,heads,dk,dv", [(3, 5, 7, 9), (2, 8, 128, 128), (1, 1, 1, 1), (4, 3, 16, 33), (3, 2, 9, 48)])
def test_recurrent_step_matches_the_spec(batch, heads, dk, dv):
    """The decode step in C++, state updated in place, against fused_recurrent (the spec), padded rows
    (g = beta = 0) leaving their state as it was."""
    from clover.ops.gated_delta_rule import fused_recurrent_gated_delta_rule, step_into

    _tiled()
    gen = torch.Generator().manual_seed(dk * dv)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, 1, heads, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(batch, 1, heads, dv, generator=gen)
    g, beta = -torch.rand(batch, 1, heads, generator=gen), torch.rand(batch, 1, heads, generator=gen)
    g[0], beta[0] = 0.0, 0.0  # a padded row: its state must not move
    state = torch.randn(batch, heads, dk, dv, generator=gen)
    out_ref, state_ref = fused_recurrent_gated_delta_rule(q, k, v, g, beta, 0.7, state.clone())
    got_state = state.clone()
    out = torch.ops.clover_cpu.recurrent_step_(q, k, v, g, beta, 0.7, got_state)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, state_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_state[0], state[0])
    assert step_into(q, k, v, g, beta, 0.7, state) is None  # eager keeps torch's ops
    from helpers import split_over_threads

    split_state = state.clone()
    with split_over_threads(2):  # the slices on a helper thread: the same numbers
        split_out = torch.ops.clover_cpu.recurrent_step_(q, k, v, g, beta, 0.7, split_state)
    assert torch.equal(split_out, out) and torch.equal(split_state, got_state)


def test_compiled_step_into_updates_the_state_in_place():
    from clover.compile import c_shim_config
    from clover.ops.gated_delta_rule import fused_recurrent_gated_delta_rule, step_into

    _tiled()
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.nn.functional.normalize(torch.randn(3, 1, 4, 16, generator=gen), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(3, 1, 4, 24, generator=gen), -torch.rand(3, 1, 4, generator=gen), torch.rand(3, 1, 4, generator=gen)
    state = torch.randn(3, 4, 16, 24, generator=gen)
    out_ref, state_ref = fused_recurrent_gated_delta_rule(q, k, v, g, beta, 0.5, state.clone())
    fn = lambda *a: step_into(*a[:5], 0.5, a[5]) * 2  # noqa: E731
    with torch.no_grad(), torch._inductor.config.patch({"cpp_wrapper": True, **c_shim_config()}):
        out = torch.compile(fn, fullgraph=True, dynamic=False)(q, k, v, g, beta, state)
    torch.testing.assert_close(out, out_ref * 2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch,hq,hkv,lq,span,d,dv,mask_heads", [(3, 4, 2, 1, 37, 24, 19, 1), (2, 8, 2, 1, 130, 128, 128, 1),
                                                                   (1, 3, 3, 2, 9, 7, 5, 3), (4, 6, 1, 3, 17, 33, 16, 1),
                                                                   (2, 6, 1, 1, 33, 32, 64, 1), (1, 4, 2, 2, 20, 16, 64, 4)])
def test_decode_attention_matches_naive(batch, hq, hkv, lq, span, d, dv, mask_heads):
    """clover_cpu::decode_attention against the reference on random inputs: K/V read as views of a
    larger cache (a slot tail past the span, heads strided), a mask with unused slots, a row that
    allows no key (zeros, as torch's SDPA); the same numbers on a helper thread."""
    from helpers import split_over_threads

    _tiled()
    gen = torch.Generator().manual_seed(span * d)
    q = torch.randn(batch, hq, lq, d, generator=gen)
    k_cache, v_cache = torch.randn(batch, span + 5, hkv, d, generator=gen), torch.randn(batch, span + 5, hkv, dv, generator=gen)
    k, v = k_cache.transpose(1, 2)[:, :, :span], v_cache.transpose(1, 2)[:, :, :span]
    mask = torch.rand(batch, mask_heads, lq, span, generator=gen) < 0.6
    mask[..., 0] = True
    mask[0, :, -1] = False  # no key at all
    out = torch.ops.clover_cpu.decode_attention(q, k, v, mask, 0.3)
    expect = naive_masked_attention(q, k, v, mask | (torch.arange(span) == 0), 0.3)  # the reference needs a key a row
    expect[0, :, -1] = 0.0
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    with split_over_threads(2):
        assert torch.equal(torch.ops.clover_cpu.decode_attention(q, k, v, mask, 0.3), out)


def test_compiled_masked_attention_takes_decode_attention_for_one_query_row():
    """A compiled graph's one-row masked attention runs decode_attention (the graph's code names it),
    with SDPA's values; eager calls keep SDPA."""
    from torch._inductor.utils import run_and_get_code

    from clover.compile import c_shim_config
    from clover.ops.block_attention import sdpa

    _tiled()
    q, k, v = torch.randn(3, 4, 1, 16), torch.randn(3, 2, 11, 16), torch.randn(3, 2, 11, 16)
    mask = torch.rand(3, 1, 1, 11) < 0.5
    mask[..., 3] = True
    assert not sdpa.decode_kernel(q, k, v, mask)
    fn = lambda *a: masked_attention(*a, 0.25) * 2  # noqa: E731
    with torch.no_grad(), torch._inductor.config.patch({"cpp_wrapper": True, **c_shim_config()}):
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True, dynamic=False), q, k, v, mask)
    assert "decode_attention" in "\n".join(code)
    torch.testing.assert_close(out, fn(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_compiled_graphs_route_unit_lower_solves():
    from clover.compile import route_solves

    _tiled()
    counts = []

    def backend(gm, example_inputs):
        counts.append(route_solves(gm))
        return gm.forward

    system = torch.randn(2, 9, 9).tril(-1) * 0.3 + torch.eye(9)
    rhs = torch.randn(2, 9, 12)
    fn = lambda a, b: torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True) * 2  # noqa: E731
    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(system, rhs)
    torch.testing.assert_close(out, fn(system, rhs), rtol=1e-5, atol=1e-5)
    assert counts == [1]


def test_compiled_graphs_call_the_ops_c_entry_points():
    """A graph compiled as the runner compiles it (inductor's C++ wrapper, compile.c_shim_config) calls
    the ops' C entry points (aoti_torch_cpu_<op>) instead of the dispatcher, with the ops' values; the
    entry points' declarations pickle (inductor's FX graph cache keys on its config)."""
    import io
    import logging
    import pickle

    from torch._inductor.codecache import output_code_log
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    from clover.compile import c_shim_config
    from clover.ops.linear import naive_linear

    tiled = _tiled()
    shims = c_shim_config()["aot_inductor.custom_ops_to_c_shims"]
    assert set(pickle.loads(pickle.dumps(shims))) == set(shims) == {
        torch.ops.clover_cpu.linear.default, torch.ops.clover_cpu.experts.default,
        torch.ops.clover_cpu.unit_lower_solve.default}
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(3, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    gate_up, down = torch.randn(4, 2 * 8, 40, generator=g) * 0.2, torch.randn(4, 40, 8, generator=g) * 0.2
    top_idx, top_w = torch.tensor([[0, 3], [1, 3], [2, 0]]), torch.rand(3, 2, generator=g)
    system, rhs = torch.randn(2, 5, 5, generator=g).tril(-1) * 0.3 + torch.eye(5), torch.randn(2, 5, 7, generator=g)

    def fn(x, w, b, top_idx, top_w, gate_up, down, system, rhs):
        ops = torch.ops.clover_cpu
        y = ops.linear(x, w, b) + ops.linear(x, w).relu()
        return y, ops.experts(x, top_idx, top_w, gate_up, down) * 2, ops.unit_lower_solve(system, rhs) + 1

    args = (x, w, b, top_idx, top_w, gate_up, down, system, rhs)
    code = io.StringIO()
    handler = logging.StreamHandler(code)
    output_code_log.addHandler(handler)
    level = output_code_log.level
    output_code_log.setLevel(logging.DEBUG)
    try:
        with torch.no_grad(), torch._inductor.config.patch(cpp_wrapper=True, debug=True, fx_graph_cache=False,
                                                             **c_shim_config()):
            got = compile_fx(make_fx(fn, tracing_mode="fake")(*args), list(args))(*args)
    finally:
        output_code_log.setLevel(level)
        output_code_log.removeHandler(handler)
    want = (naive_linear(x, w, b) + naive_linear(x, w).relu(), tiled.tiled_experts(x, top_idx, top_w, gate_up, down) * 2,
            torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True) + 1)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    src = code.getvalue()
    for op in ("linear", "experts", "unit_lower_solve"):
        assert f"aoti_torch_cpu_{op}(" in src
    assert "aoti_torch_call_dispatcher" not in src


@pytest.mark.parametrize("tokens,experts,topk,hidden,inter", [(1, 8, 2, 256, 128), (9, 8, 2, 256, 128),
                                                              (33, 5, 3, 40, 24), (64, 8, 2, 17, 9),
                                                              (61, 4, 2, 64, 96)])  # ~30 rows an expert: AMX
@pytest.mark.parametrize("bf16_values", [False, True])
def test_tiled_experts_match_naive(tokens, experts, topk, hidden, inter, bf16_values):
    from clover.ops.moe import naive_experts

    tiled = _tiled()
    torch.manual_seed(1)
    x = torch.randn(tokens, hidden)
    gate_up, down = torch.randn(experts, 2 * inter, hidden) / hidden**0.5, torch.randn(experts, hidden, inter) / inter**0.5
    if bf16_values:  # bf16 panels for one projection only: the op mixes panel types
        down = down.bfloat16().float()
        if tokens > 32:  # and both in bf16
            gate_up = gate_up.bfloat16().float()
        assert tiled.bf16_panels(down) == BF16_PANELS and tiled.bf16_panels(gate_up) == (BF16_PANELS and tokens > 32)
    top_w, top_idx = torch.softmax(torch.randn(tokens, experts), -1).topk(topk, dim=-1)
    want = naive_experts(x, top_idx, top_w, gate_up, down)
    torch.testing.assert_close(tiled.tiled_experts(x, top_idx, top_w, gate_up, down), want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        down.mul_(-1)  # repacked after an in-place update
    torch.testing.assert_close(tiled.tiled_experts(x, top_idx, top_w, gate_up, down), -want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("inter", [9, 16, 40])
def test_tiled_experts_swiglu_over_the_whole_fp32_range(inter):
    """The experts' SwiGLU (a vector exp where AVX-512 is built) against the naive experts in fp64 on
    gate values from 1e-3 to past exp's fp32 range on both sides (silu -> 0 and -> g, no inf or nan):
    odd widths (masked tails), 5 tokens, top 2 of 3 experts."""
    from clover.ops.moe import naive_experts

    tiled = _tiled()
    torch.manual_seed(2)
    tokens, experts, hidden = 5, 3, 16
    x = torch.randn(tokens, hidden)
    gate_up = torch.randn(experts, 2 * inter, hidden) / hidden**0.5
    gate_up[:, :inter] *= torch.logspace(-3, 2.5, inter)[:, None]  # gates up to ~|300|: exp(-g) over- and underflows
    down = torch.randn(experts, hidden, inter) / inter**0.5
    top_w, top_idx = torch.softmax(torch.randn(tokens, experts), -1).topk(2, dim=-1)
    got = tiled.tiled_experts(x, top_idx, top_w, gate_up, down)
    want = naive_experts(x.double(), top_idx, top_w.double(), gate_up.double(), down.double())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("shape", [(2, 5, 37), (3, 4099), (1, 8, 4096), (2, 3, 1, 17)])
@pytest.mark.parametrize("kernel", ["cpp", "torch"])
def test_greedy_pick_matches_naive(shape, kernel):
    """The greedy token (first maximum) and its softmax probability without the distribution: the C++
    kernel and the torch form against softmax + argmax + gather. Odd vocabularies (vector tails),
    batch dims, banned ids (duplicated, unsorted, holding the largest logit), exact ties, -inf
    logits; tokens identical, probabilities within fp32 rounding."""
    from clover.ops.greedy_pick import naive_greedy_pick, torch_greedy_pick

    if kernel == "cpp":
        _tiled()
        pick = torch.ops.clover_cpu.greedy_pick
    else:
        pick = torch_greedy_pick
    g = torch.Generator().manual_seed(shape[-1])
    vocab = shape[-1]
    for trial in range(4):
        logits = torch.randn(*shape, generator=g) * (1 + 4 * trial)
        banned = torch.tensor([3, vocab - 1, 0, 3])
        logits[..., 3] = logits.max() + 1  # the largest logit is banned
        if trial == 1:  # exact ties: the lowest id wins
            logits[..., 5] = logits[..., vocab - 2] = logits[..., 7] = logits.max() + 1
        if trial == 2:
            logits[..., 10:] = float("-inf")
        if trial == 3:
            banned = torch.tensor([], dtype=torch.long)
        ref_tokens, ref_probs = naive_greedy_pick(logits, banned)
        tokens, probs = pick(logits, banned)
        assert tokens.shape == probs.shape == shape[:-1] and tokens.dtype == torch.long and probs.dtype == torch.float32
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)
    everything = torch.arange(vocab)  # all ids banned: no distribution (NaN), as torch's softmax
    assert pick(logits, everything)[1].isnan().all()


_OTHER_BUILD = r'''
import sys, tempfile, torch
from torch.utils.cpp_extension import load
from clover.ops.linear import naive_linear
from clover.ops.linear.tiled import _SOURCE
from clover.ops.moe import naive_experts

march, want = sys.argv[1], sys.argv[2]
load(name="clover_cpu_ops_" + march.replace("-", "_"), sources=[str(_SOURCE)], extra_cflags=["-O3", "-march=" + march],
     build_directory=tempfile.mkdtemp(), is_python_module=False, verbose=False)
assert torch.ops.clover_cpu.simd() == want, torch.ops.clover_cpu.simd()
torch.manual_seed(0)
with torch.no_grad():
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17):
        for k, n in ((6, 5), (13, 777), (30, 16), (256, 40), (129, 33)):
            for bf16_values in (False, True):
                x, w, b = torch.randn(2, rows, k), torch.randn(n, k) / k**0.5, torch.randn(n)
                if bf16_values:
                    w = w.bfloat16().float()
                bias = b if rows % 2 else None
                got = torch.ops.clover_cpu.linear(x, w, bias)
                torch.testing.assert_close(got, naive_linear(x, w, bias), rtol=1e-5, atol=1e-5)
                assert bool(torch.ops.clover_cpu.packed_bf16(w)) == (bf16_values and want != "none")
                # a row's result is the same bits whatever rows share its call (tile shapes differ)
                for r in {0, rows - 1, 2 * rows - 1}:
                    alone = torch.ops.clover_cpu.linear(x.reshape(-1, k)[r:r + 1], w, bias)
                    assert torch.equal(alone[0], got.reshape(-1, n)[r]), (rows, k, n, bf16_values, r)
    x, gate_up, down = torch.randn(11, 24), torch.randn(6, 2 * 20, 24) / 5, torch.randn(6, 24, 20).bfloat16().float() / 5
    top_w, top_idx = torch.softmax(torch.randn(11, 6), -1).topk(2, dim=-1)
    torch.testing.assert_close(torch.ops.clover_cpu.experts(x, top_idx, top_w, gate_up, down),
                               naive_experts(x, top_idx, top_w, gate_up, down), rtol=1e-5, atol=1e-5)
print("ok")
'''


@pytest.mark.parametrize("march,want", [("x86-64-v3", "avx2"), ("x86-64-v2", "none")])
def test_tiled_kernels_built_for_other_cpus_match_naive(march, want, tmp_path):
    """The kernels as a CPU without AVX-512 builds them (-march=native there): AVX2 + FMA tiles
    (x86-64-v3: 1 row x 4 panels, 2 x 2, up to 4 rows x 1 panel of two 8-float halves, bf16 panels
    widened) and the plain C++ of an older CPU (x86-64-v2: fp32 panels). Built in a child process (the
    op library has one home per process) and checked against the naive linear and experts: odd K,
    partial panels, rows of 1-17, batch 2; and a row alone gives the bits it gives among others."""
    import subprocess
    import sys

    tiled = _tiled()
    if want == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU cannot run AVX2 code")
    script = tmp_path / "other_build.py"
    script.write_text(_OTHER_BUILD)
    out = subprocess.run([sys.executable, str(script), march, want], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    assert tiled.simd() in ("avx512", "avx2", "none")


def test_tiled_linears_are_routed_only_with_vector_tiles():
    tiled = _tiled()
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):  # -march=native: the build follows this CPU
        assert tiled.simd() == cap.lower()
    from clover.ops.linear import worth_routing

    assert worth_routing(torch.randn(8, 8)) == (tiled.simd() != "none")
    assert not worth_routing(torch.randn(8, 8, dtype=torch.float64))
