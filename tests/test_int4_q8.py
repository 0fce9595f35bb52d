"""`clover_cpu::int4_q8_linear` / `int4_q8_experts` (ops/linear/int4_q8.cpp: int4 weights x int8
activations) against their references on random inputs: the layout's round trip, the activations'
rounding, odd group counts, output counts not a multiple of 16, rows 1..70, batch dims, bf16 in and
out, a row's result independent of its neighbours, the builds of CPUs without AVX-512 / VNNI, the
int4 modules' opt-in (the layout's round trip, the kernel against its reference on a grid, shape
mistakes and the traced op: test_int4_linear.py, for both int4 kernels).

Tolerances: the kernel's integer dot products are exact, so against `naive_int4_q8_linear` (fp64 on
the same rounded activations) it is within K + 1 fp32 roundings of the summed |products|. Against the
fp32-activation int4 kernel the difference is the activations' rounding: per output at most
sum_k |W[n, k]| * d(k) / 2 (d the block's scale, max|x_block| / 127), checked per element; on these
Gaussian inputs it stays under 1% of the largest output."""

from __future__ import annotations

import pytest
import torch

from clover.ops.linear import int4_linear as il, int4_q8 as q8, tiled
from clover.ops.linear.naive import naive_int4_q8_linear, naive_int4_q8_weight, naive_q8_activations
from clover.ops.linear.naive import naive_q8_rounded as rounded
from clover.quant.int4 import dequantize, quantize_rtn

pytestmark = pytest.mark.skipif(not tiled.available() or not q8.available(), reason="the clover CPU kernels are not built here")


from helpers import check_int4, int4_stored as stored  # noqa: E402


def check(y, x, w):
    """|y - xq W^T| within K + 1 fp32 roundings of the summed |products| (xq the rounded x)."""
    check_int4(y, x, w, rounded)


def ties():
    """Rows whose blocks hold exact ties after scaling (max 127, so x * (1 / d) = x): +-k.5."""
    x = (torch.arange(2 * 64, dtype=torch.float32) % 64 - 31.5).reshape(2, 64)
    x[:, 0], x[:, 32] = 127, -127
    return x


def test_activation_rounding():
    x = torch.randn(3, 4 * 32) * torch.tensor([1e-3, 1.0, 50.0, 1.0]).repeat_interleave(32)
    x[1, 96:] = 0  # a block of zeros: scale 0, codes 0
    x[0, :64] = ties()[0]
    a, d = naive_q8_activations(x)
    assert a.dtype == torch.int8 and d.shape == (3, 4) and a.abs().max() <= 127
    assert (a.view(3, 4, 32).abs().amax(-1)[d > 0] == 127).all() and (a[1, 96:] == 0).all() and d[1, 3] == 0
    assert a[0, 1:4].tolist() == [-30, -30, -28] and a[0, 33:36].tolist() == [2, 2, 4]  # -30.5 -29.5 -28.5, 1.5 2.5 3.5
    err = (rounded(x) - x.double()).abs().view(3, 4, 32)
    assert (err <= d.double()[..., None] / 2 * (1 + 2**-20)).all()
    packed, sz = q8.pack(**stored(24, 128, 32))
    check(q8.int4_q8_linear(x, packed, sz, 32, 24), x, naive_int4_q8_weight(packed, sz, 24))  # the kernel rounds alike


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_close_to_the_fp32_activation_kernel(rows):
    n, k, g = 300, 1024, 128
    st = stored(n, k, g, seed=5)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(6))
    y = q8.int4_q8_linear(x, *q8.pack(**st), g, n).double()
    fp32 = il.int4_linear(x, *il.pack(**st), g, n).double()
    w = dequantize(**st).double()
    _, d = naive_q8_activations(x)
    bound = (d.double().repeat_interleave(32, dim=-1) / 2) @ w.abs().T  # sum_k |W| d / 2
    assert ((y - fp32).abs() <= bound * (1 + 1e-4) + 1e-5 * fp32.abs().max()).all()
    assert (y - fp32).abs().max() < 0.01 * fp32.abs().max()


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_experts_op_equals_the_reference_experts(tokens):
    """`clover_cpu::int4_q8_experts` (an Int4Experts on kernel "int8") against the routed experts with
    every projection through `naive_int4_q8_linear`, the pairs summed in slot order."""
    from clover.quant.modules import Int4Experts

    e, h, i = 6, 96, 64
    experts = Int4Experts(e, h, i, 32)
    gen = torch.Generator().manual_seed(tokens)
    experts.gate_up_proj.load_stored(quantize_rtn(torch.randn(e, 2 * i, h, generator=gen) * 0.1, 32))
    experts.down_proj.load_stored(quantize_rtn(torch.randn(e, h, i, generator=gen) * 0.1, 32))
    for m in (experts.gate_up_proj, experts.down_proj):
        m.set_kernel("int8")
    x = torch.randn(tokens, h, generator=gen)
    top_w, top_idx = torch.rand(tokens, e, generator=gen).softmax(-1).topk(2, dim=-1)
    got = experts(x, top_idx, top_w)
    assert experts.gate_up_proj._packed[0].kind == "clover_q8"
    (gu, gu_sz), (dn, dn_sz) = experts.gate_up_proj.clover_stack(), experts.down_proj.clover_stack()
    ref = torch.zeros(tokens, h, dtype=torch.float64)
    for t in range(tokens):
        for s in range(2):
            ex = top_idx[t, s]
            gate, up = naive_int4_q8_linear(x[t:t + 1], gu[ex], gu_sz[ex], 32, 2 * i).split(i, dim=-1)
            out = naive_int4_q8_linear(torch.nn.functional.silu(gate) * up, dn[ex], dn_sz[ex], 32, h)
            ref[t] += top_w[t, s].double() * out[0].double()
    # a hidden value within fp32 rounding of another int8 rounding boundary may round the other way
    assert (got.double() - ref).abs().max() <= 1e-3 * ref.abs().max()
    assert experts(x.bfloat16(), top_idx, top_w.bfloat16()).dtype == torch.bfloat16


def test_int4_modules_opt_in():
    """Int4Linear: "auto" keeps the fp32-activation kernel unless `use_int8_activations(True)` (or
    CLOVER_INT4_ACTIVATIONS=int8) was set when it packed; kernel "int8" asks for it; the stored format
    survives the layout."""
    from clover.quant import Int4Linear

    layer = Int4Linear.from_float(torch.randn(40, 128) * 0.05, 32)
    stored_before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(3, 128)
    layer(x)
    assert layer._packed[0].kind == "clover"
    was = q8.use_int8_activations(True)
    try:
        layer.set_kernel("reference")
        layer.set_kernel("auto")
        y = layer(x)
        assert layer._packed[0].kind == "clover_q8"
    finally:
        q8.use_int8_activations(was)
    packed, sz = layer._packed[0].weight, layer._packed[0].sz
    assert torch.equal(y, q8.int4_q8_linear(x, packed, sz, 32, 40))
    layer.set_kernel("int8")
    assert all(torch.equal(v, stored_before[k]) for k, v in layer.state_dict().items())
    with pytest.raises(ValueError, match="int8"):
        layer.set_kernel("int9")


def test_a_group_must_hold_whole_blocks():  # the other shape mistakes and the traced op: test_int4_linear.py
    packed, sz = q8.pack(**stored(32, 128, 32))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q8.int4_q8_linear(torch.randn(2, 128), packed, sz, 16, 32)


_OTHER_BUILD = r'''
import sys, tempfile, torch
from pathlib import Path
from torch.utils.cpp_extension import load
from clover.ops.linear import int4_q8 as q8
from clover.ops.linear.naive import naive_int4_q8_linear
from clover.quant.int4 import quantize_rtn

flags = sys.argv[1:]
source = Path(q8.__file__).with_name("int4_q8.cpp")
load(name="clover_q8_" + "_".join(f.strip("-").replace("-", "_").replace("=", "_") for f in flags), sources=[str(source)],
     extra_cflags=["-O3", *flags], build_directory=tempfile.mkdtemp(), is_python_module=False, verbose=False)
gen = torch.Generator().manual_seed(0)
for n, k, g in ((37, 96, 32), (129, 384, 128)):
    packed, sz = q8.pack(**quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, g))
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(2, rows, k, generator=gen)
        x[0, 0, :64] = (torch.arange(64) - 31.5).float()  # exact ties after scaling: nearest even
        x[0, 0, 0] = x[0, 0, 32] = 127
        got = torch.ops.clover_cpu.int4_q8_linear(x, packed, sz, g, n)
        torch.testing.assert_close(got, naive_int4_q8_linear(x, packed, sz, g, n), rtol=1e-5, atol=1e-5)
        alone = torch.ops.clover_cpu.int4_q8_linear(x[1, -1:], packed, sz, g, n)
        assert torch.equal(alone[0], got[1, -1]), (n, k, rows)
print("ok")
'''


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.parametrize("flags,needs", [
    (["-march=x86-64-v3"], {"avx2", "fma"}), (["-march=x86-64-v3", "-mavxvnni"], {"avx2", "fma", "avx_vnni"}),
    (["-march=skylake-avx512"], {"avx512f", "avx512bw", "avx512vl", "avx512dq"}), (["-march=x86-64-v2"], set())],
    ids=["avx2", "avx-vnni", "avx512-no-vnni", "plain"])
def test_kernels_built_for_other_cpus_match_naive(flags, needs, tmp_path):
    """The kernel as CPUs without AVX-512 VNNI build it: AVX2 maddubs (x86-64-v3), AVX-VNNI, AVX-512
    without VNNI, and plain C++ (x86-64-v2), each built alone in a child process."""
    import subprocess
    import sys

    if not needs <= cpu_flags():
        pytest.skip("this CPU cannot run that build")
    script = tmp_path / "other_build.py"
    script.write_text(_OTHER_BUILD)
    out = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_two_threads_give_the_numbers_of_one():
    """Split over two threads (every call, parallel.h) the linear and the experts give one thread's
    numbers bit for bit: odd output count, batch 2."""
    from helpers import split_over_threads

    from clover.quant.modules import Int4Experts

    n, k, g = 77, 96, 32
    packed, sz = q8.pack(**stored(n, k, g))
    x = torch.randn(2, 9, k, generator=torch.Generator().manual_seed(1))
    experts = Int4Experts(5, 64, 32, 32)
    gen = torch.Generator().manual_seed(2)
    experts.gate_up_proj.load_stored(quantize_rtn(torch.randn(5, 64, 64, generator=gen) * 0.1, 32))
    experts.down_proj.load_stored(quantize_rtn(torch.randn(5, 64, 32, generator=gen) * 0.1, 32))
    for m in (experts.gate_up_proj, experts.down_proj):
        m.set_kernel("int8")
    xe = torch.randn(7, 64, generator=gen)
    top_w, top_idx = torch.rand(7, 5, generator=gen).softmax(-1).topk(2, dim=-1)
    one = q8.int4_q8_linear(x, packed, sz, g, n), experts(xe, top_idx, top_w)
    with split_over_threads(2):
        two = q8.int4_q8_linear(x, packed, sz, g, n), experts(xe, top_idx, top_w)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    torch.testing.assert_close(two[0], naive_int4_q8_linear(x, packed, sz, g, n), rtol=1e-5, atol=1e-5)
