"""The CUDA paths on one GPU (bench/gpu.sh runs this file): eager CUDA == eager CPU, compiled CUDA
(CUDA graphs, mode="reduce-overhead") == eager CUDA with no recompilation once warm, and the int4
CUDA kernel == the dequantised reference. Skipped cleanly without CUDA."""

import pytest
import torch
import torch.nn.functional as F

from clover.engine.runner import CompiledRunner, EagerRunner, compile_deferred
from clover.quant.int4 import dequantize, kernel_kind
from clover.quant.modules import Int4Linear
from helpers import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def steps(runner, ids, rows):
    """Prefill, then an AR step and a 4-token draft step twice (the second pair replays)."""
    cache = runner.new_cache(rows, 64)
    out = [runner.forward(ids[:, :-5], cache, logits_to_keep=1)]
    snap = cache.snapshot()
    for _ in range(2):
        out.append(runner.forward(ids[:, -5:-4], cache, logits_to_keep=1))
        out.append(runner.forward(ids[:, -4:], cache, block_size=4, draft_len=4, clean_block_size=4, logits_to_keep=4))
        cache.restore(snap)
    return [o.float().cpu() for o in out]


@pytest.fixture(scope="module")
def models():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu = tiny_model(5, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    gpu = tiny_model(5, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]).cuda()
    return cpu, gpu


def test_eager_cuda_equals_cpu(models):
    cpu, gpu = models
    ids = torch.randint(0, 120, (3, 13))
    with torch.inference_mode():
        want = steps(EagerRunner(cpu), ids, 3)
        got = steps(EagerRunner(gpu), ids.cuda(), 3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_compiled_cuda_graphs_equal_eager_without_recompiling(models):
    _, gpu = models
    ids = torch.randint(0, 120, (2, 11)).cuda()
    with torch.inference_mode():
        want = steps(EagerRunner(gpu), ids, 2)
        got = steps(CompiledRunner(gpu), ids, 2)
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        again = steps(CompiledRunner(gpu), ids, 2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before, "recompiled when warm"
    for a, b, c in zip(got, want, again):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-5)


def test_compiled_cuda_rows_in_buckets_and_deferred_shapes_equal_eager(models):
    """A server's compiled runner on CUDA: 3 rows run the 4-row graphs (a spare row), new shapes run
    eagerly until `compile_deferred` compiled them (CUDA graphs capture nothing for a Replay: the
    shapes must still count as compiled), then through the graphs; every step equals eager."""
    _, gpu = models
    ids = torch.randint(0, 120, (3, 11)).cuda()
    with torch.inference_mode():
        want = steps(EagerRunner(gpu), ids, 3)
        first = CompiledRunner(gpu, defer=True)
        got = steps(first, ids, 3)
        assert first.compiled_calls == 0 and first.eager_calls > 0  # no 4-row graph yet: all deferred
        while compile_deferred(gpu):
            pass
        warm = CompiledRunner(gpu, defer=True)
        again = steps(warm, ids, 3)
    assert warm.eager_calls == 0 and warm.compiled_calls > 0
    for a, b, c in zip(got, want, again):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_int4_cuda_kernel_equals_reference(rows):
    assert kernel_kind(torch.device("cuda")) == "cuda"
    torch.manual_seed(rows)
    layer = Int4Linear.from_float(torch.randn(200, 128) * 0.05, 32, bias=torch.randn(200)).cuda()
    x = torch.randn(rows, 128, dtype=torch.bfloat16, device="cuda")
    ref = F.linear(x.float(), dequantize(layer.qweight, layer.scales, layer.qzeros), layer.bias.float())
    layer.set_kernel("auto")
    y = layer(x)
    assert layer._packed is not None and layer._packed[0].kind == "cuda"  # the tinygemm kernel ran
    torch.testing.assert_close(y.float(), ref, atol=0.02, rtol=0.02)
