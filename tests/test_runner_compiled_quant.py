"""The compiled runner on an int4 model (issue 54) and on a bf16 one: the int4 layers run their CPU
kernel inside the graph (the kernel layout held as buffers, `Int4Weight.prepare_for_graphs`; the
routed experts as one opaque op, `clover::int4_experts`), so a decode through the compiled runner
gives the eager int4 decode's tokens and forwards, logits within the kernels' bf16 rounding, and a
warm decode compiles nothing and replays every step. The same for the weights in bf16 where the CPU
has bf16 products. Clover's own model and a public family (SDAR-MoE)."""

from __future__ import annotations

import copy

import pytest
import torch

from clover.quant import Int4Experts, Int4Linear
from clover.quant.int4 import cpu_kernel_available
from clover.quant.modules import quantize_rtn_in_place
from helpers import tiny_model
from test_runner_compiled import decode, graphs

G = 32
PROMPTS = [[5, 9, 2, 7, 7, 1, 3, 11, 4], [8, 3, 30, 2, 6]]
needs_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="torch has no int4 CPU kernel here")


@pytest.fixture(scope="module")
def model():
    return tiny_model(99, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


def close_decodes(model, mode="low_confidence", rel=2e-2):
    """Compiled == eager: tokens and forwards, every call's logits within `rel` of the largest; warm:
    no recompile, every step replayed."""
    ref_logits, ref, _ = decode(model, "eager", mode, PROMPTS)
    got_logits, got, runner = decode(model, "compiled", mode, PROMPTS)
    assert [s.token_ids for s in got] == [s.token_ids for s in ref]
    assert [s.forward_passes for s in got] == [s.forward_passes for s in ref]
    assert len(got_logits) == len(ref_logits)
    for (a, a_index), (b, b_index) in zip(got_logits, ref_logits):
        if a_index is None and b_index is not None:
            a = a[:, b_index]
        assert (a.float() - b.float()).abs().max() <= rel * b.float().abs().max()
    assert runner.compiled_calls > runner.eager_calls
    before = graphs(model)
    _, again, warm = decode(model, "compiled", mode, PROMPTS)
    assert graphs(model) == before, "recompiled in a warm decode"
    assert [s.token_ids for s in again] == [s.token_ids for s in ref]
    assert warm.replayed_calls == warm.compiled_calls > 0


@needs_kernel
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode", ["ar", "low_confidence"])
def test_compiled_int4_equals_eager_int4(model, mode):
    q = quantize_rtn_in_place(copy.deepcopy(model), G)
    assert any(isinstance(m, Int4Experts) for m in q.modules()) and any(isinstance(m, Int4Linear) for m in q.modules())
    close_decodes(q, mode)


@pytest.mark.timeout(1800)
def test_compiled_int4_int8_activations_equals_eager(model):
    """The int4 x int8-activation kernel (Int4Weight kernel "int8") inside the graph: `clover_cpu::int4_q8_linear`
    and `int4_q8_experts` on the layout held as buffers."""
    from clover.ops.linear import int4_q8
    from clover.quant.modules import Int4Weight, set_int4_kernel

    if not int4_q8.available():
        pytest.skip("the clover CPU kernels are not built here")
    q = quantize_rtn_in_place(copy.deepcopy(model), G)
    set_int4_kernel(q, "int8")
    close_decodes(q, "ar")
    assert {p.kind for m in q.modules() if isinstance(m, Int4Weight) for p in m._packed or ()} == {"clover_q8"}


@pytest.mark.timeout(1800)
def test_compiled_bf16_equals_eager_bf16(model):
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no bf16 products on this CPU")
    close_decodes(copy.deepcopy(model).to(torch.bfloat16), "low_confidence", rel=5e-2)


@needs_kernel
@pytest.mark.timeout(1800)
def test_compiled_int4_family_equals_eager_int4(tmp_path):
    """A family's int4 folder (`clover quantize --model DIR --out DIR`) through the compiled runner."""
    from test_families import write_family
    from test_families_compiled import decode as family_decode, prompts

    from clover.cli import main
    from clover.models.families import load_family
    from clover.models.family_seam import FamilySeam

    write_family(tmp_path / "src", "sdar_moe")
    assert main(["quantize", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "q"), "--group-size", str(G)]) == 0
    loaded = load_family(tmp_path / "q", dtype=torch.float32)
    loaded.model.lm_head.weight.data *= 30.0  # confident: several tokens per forward
    seam = FamilySeam(loaded)
    batch, budgets = prompts(), [9, 6, 11]
    ref_logits, ref, ref_forwards, _ = family_decode(seam, "eager", batch, budgets, 4)
    got_logits, got, forwards, runner = family_decode(seam, "compiled", batch, budgets, 4)
    assert got == ref and forwards == ref_forwards
    assert runner.compiled_calls > 0 and runner.eager_calls == 0
    for (a, a_index), (b, b_index) in zip(got_logits, ref_logits):
        a = a[:, b_index] if a_index is None and b_index is not None else a
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()
