"""`clover_cpu::int4_linear` (ops/linear/int4.cpp) against its reference on random inputs: odd output
counts, rows 1..70, several group sizes, bf16 in and out, a row's result independent of the rows it
shares a call with, the layout's exact round trip to the stored format, and the op traced by
torch.compile.

Tolerance: every weight is dequantised exactly (fma(q, s, -z s) = (q - z) s holds in fp32), so the
kernel computes fp32 dot products of exact operands; one FMA chain of K terms is within K * 2^-24 of
the summed |products| (plus the output's own rounding), against an fp64 reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from clover.ops.linear import int4_linear as il, int4_q8 as q8, tiled
from clover.ops.linear.naive import (naive_int4_linear, naive_int4_q8_linear, naive_int4_q8_weight, naive_int4_weight,
                                     naive_q8_rounded)
from clover.quant.int4 import dequantize, quantize_rtn

pytestmark = pytest.mark.skipif(not tiled.available(), reason="the clover CPU kernels are not built here")


from helpers import check_int4 as check, int4_stored as stored  # noqa: E402


# Both int4 kernels, fp32 activations (int4.cpp) and int8 activations (int4_q8.cpp): pack, unpack, op,
# the references, the packed shape, the complaint about an input of the wrong width, the activations.
KERNELS = {
    "int4": SimpleNamespace(pack=il.pack, unpack=il.unpack, op=il.int4_linear, weight=naive_int4_weight,
                            linear=naive_int4_linear, shape=lambda n, k: (-(-n // 16), k // 2, 16),
                            wrong_width="features", activations=None),
    "int4_q8": SimpleNamespace(pack=q8.pack, unpack=q8.unpack, op=q8.int4_q8_linear, weight=naive_int4_q8_weight,
                               linear=naive_int4_q8_linear, shape=lambda n, k: (-(-n // 16), k // 8, 16, 4),
                               wrong_width="K / 8", activations=naive_q8_rounded),
}


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(1, 128), (17, 256), (200, 384), (513, 128)])
def test_layout_round_trips_and_dequantises_exactly(kind, n, k, g):
    kn, st = KERNELS[kind], stored(n, k, g)
    packed, sz = kn.pack(**st)
    assert packed.shape == kn.shape(n, k) and sz.shape == (-(-n // 16), k // g, 2, 16)
    assert torch.equal(kn.weight(packed, sz, n), dequantize(**st))
    for got, want in zip(kn.unpack(packed, sz, n), (st["qweight"], st["scales"], st["qzeros"])):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 33, 64, 70])
@pytest.mark.parametrize("n,k,g", [(37, 64, 32), (16, 128, 64), (250, 384, 128), (1, 160, 32), (129, 640, 128)])
def test_kernel_equals_reference(kind, rows, n, k, g):
    kn = KERNELS[kind]
    packed, sz = kn.pack(**stored(n, k, g, seed=rows))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + 1))
    y = kn.op(x, packed, sz, g, n)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    check(y, x, kn.weight(packed, sz, n), kn.activations)
    torch.testing.assert_close(y, kn.linear(x, packed, sz, g, n), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KERNELS)
def test_batched_bf16_and_not_contiguous_inputs(kind):
    kn, (n, k, g) = KERNELS[kind], (45, 96, 32)  # three groups
    packed, sz = kn.pack(**stored(n, k, g))
    w = kn.weight(packed, sz, n)
    x = torch.randn(3, 5, k)
    y = kn.op(x, packed, sz, g, n)
    assert y.shape == (3, 5, n)
    check(y, x, w, kn.activations)
    xb = x.bfloat16()
    yb = kn.op(xb, packed, sz, g, n)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, kn.op(xb.float(), packed, sz, g, n).bfloat16())
    assert kn.op(x[:, :0], packed, sz, g, n).shape == (3, 0, n)
    xt = torch.randn(k, 7).t()  # not contiguous
    check(kn.op(xt, packed, sz, g, n), xt, w, kn.activations)


@pytest.mark.parametrize("kind", KERNELS)
def test_a_rows_result_does_not_depend_on_its_neighbours(kind):
    kn, (n, k, g) = KERNELS[kind], (100, 256, 64)
    packed, sz = kn.pack(**stored(n, k, g))
    x = torch.randn(70, k)
    alone = torch.cat([kn.op(x[i:i + 1], packed, sz, g, n) for i in range(70)])
    for rows in (2, 5, 7, 13, 70):
        assert torch.equal(kn.op(x[:rows], packed, sz, g, n), alone[:rows])


@pytest.mark.parametrize("kind", KERNELS)
def test_shape_mistakes_are_refused(kind):
    kn = KERNELS[kind]
    packed, sz = kn.pack(**stored(32, 128, 32))
    with pytest.raises(RuntimeError, match=kn.wrong_width):
        kn.op(torch.randn(2, 64), packed, sz, 32, 32)
    with pytest.raises(RuntimeError, match="sz"):
        kn.op(torch.randn(2, 128), packed, sz, 64, 32)


@pytest.mark.parametrize("kind", KERNELS)
def test_traced_by_torch_compile(kind):
    pack, op = KERNELS[kind].pack, KERNELS[kind].op
    n, k, g = 40, 128, 32
    packed, sz = pack(**stored(n, k, g))
    fn = torch.compile(lambda x, p, s: torch.relu(op(x, p, s, g, n)), backend="aot_eager", fullgraph=True)
    x = torch.randn(3, k)
    assert torch.equal(fn(x, packed, sz), torch.relu(op(x, packed, sz, g, n)))


def test_int4_model_logits_match_the_reference_path():
    """A whole int4 model (fp32 elsewhere) on clover's kernel against `set_int4_kernel("reference")`
    (dequantise, then F.linear): the same weights, fp32 sums in another order, so the logits agree to
    fp32 rounding, far inside torch's int4 kernel's bf16 activations."""
    from helpers import tiny_model

    from clover.quant.modules import Int4Weight, quantize_rtn_in_place, set_int4_kernel

    q = quantize_rtn_in_place(tiny_model(7), 32)
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fast = q(ids, block_size=8, draft_len=8).logits
        kinds = {p.kind for m in q.modules() if isinstance(m, Int4Weight) for p in m._packed or ()}
        set_int4_kernel(q, "reference")
        ref = q(ids, block_size=8, draft_len=8).logits
    assert kinds == {"clover"}
    assert (fast - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_int4_experts_op_equals_the_reference_experts(tokens):
    """`clover_cpu::int4_experts` (what an Int4Experts runs on clover's kernel, eager and compiled)
    against the grouped reference on the dequantised stacks, and a bf16 x."""
    from clover.ops.moe import grouped_experts
    from clover.quant.modules import Int4Experts

    e, h, i = 6, 96, 32
    experts = Int4Experts(e, h, i, 32)
    gen = torch.Generator().manual_seed(tokens)
    gu, dn = torch.randn(e, 2 * i, h, generator=gen) * 0.1, torch.randn(e, h, i, generator=gen) * 0.1
    experts.gate_up_proj.load_stored(quantize_rtn(gu, 32))
    experts.down_proj.load_stored(quantize_rtn(dn, 32))
    x = torch.randn(tokens, h, generator=gen)
    top_w, top_idx = torch.rand(tokens, e, generator=gen).softmax(-1).topk(2, dim=-1)
    ref = grouped_experts(x.double(), top_idx, top_w.double(), dequantize(*experts.gate_up_proj.stored()).double(),
                          dequantize(*experts.down_proj.stored()).double())
    got = experts(x, top_idx, top_w)
    assert experts.gate_up_proj.clover_stack() is not None  # the C++ op ran
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert experts(x.bfloat16(), top_idx, top_w.bfloat16()).dtype == torch.bfloat16



@pytest.mark.parametrize("rows,n,k,g", [(1, 77, 96, 32), (9, 250, 128, 64), (20, 45, 64, 32)])
def test_two_threads_give_the_numbers_of_one(rows, n, k, g):
    """Split over two threads (every call, whatever its size) the kernel's numbers are one thread's
    bit for bit, and within the reference's bound: odd output counts, batch 2."""
    from helpers import split_over_threads

    packed, sz = il.pack(**stored(n, k, g, seed=rows))
    x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(rows))
    one = il.int4_linear(x, packed, sz, g, n)
    with split_over_threads(2):
        two = il.int4_linear(x, packed, sz, g, n)
    assert torch.equal(one, two)
    check(two.reshape(-1, n), x.reshape(-1, k), naive_int4_weight(packed, sz, n))


def test_int4_experts_on_two_threads_give_the_numbers_of_one():
    from helpers import split_over_threads

    from clover.ops.moe import naive_experts

    e, h, i, g, tokens = 5, 64, 32, 32, 7
    gen = torch.Generator().manual_seed(5)
    gu, dn = stored(e * 2 * i, h, g, seed=1), stored(e * h, i, g, seed=2)
    packs = [il.pack(**st) for st in (gu, dn)]
    gu_p, gu_sz = (t.reshape(e, -1, *t.shape[1:]) for t in packs[0])
    dn_p, dn_sz = (t.reshape(e, -1, *t.shape[1:]) for t in packs[1])
    x = torch.randn(tokens, h, generator=gen)
    top_w, top_idx = torch.rand(tokens, e, generator=gen).softmax(-1).topk(2, dim=-1)
    one = il.int4_experts(x, top_idx, top_w, gu_p, gu_sz, dn_p, dn_sz, g, i)
    with split_over_threads(2):
        two = il.int4_experts(x, top_idx, top_w, gu_p, gu_sz, dn_p, dn_sz, g, i)
    assert torch.equal(one, two)
    want = naive_experts(x, top_idx, top_w, dequantize(**gu).reshape(e, 2 * i, h), dequantize(**dn).reshape(e, h, i))
    torch.testing.assert_close(two, want, atol=1e-5, rtol=1e-5)
