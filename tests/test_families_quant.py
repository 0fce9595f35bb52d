"""int4 of the public families (`clover quantize --model DIR --out DIR`, convert/quantize.py
quantize_family): the folder it writes loads through the family loader with the int4 modules in
place, its stored codes are `quantize_rtn`'s of the fp32 weights exactly, its logits with the
reference kernel equal those of the fp32 model whose weights were replaced by their dequantised
int4 (1e-5), the CPU kernel's (bf16 activations) are close to those, and the int4 model's logits
are close to the fp32 model's; `clover generate` decodes the int4 folder. Tiny random folders in the
published layout (tests/test_families.py writes them)."""

from __future__ import annotations

import json

import pytest
import torch
from test_families import VOCAB, write_family
from test_families_engine import _clover

from clover.cli import main
from clover.models.families import load_family
from clover.quant import Int4Experts, Int4Linear, dequantize, quantize_rtn, set_int4_kernel
from clover.quant.modules import quantized_targets

G = 32


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def dequantised(model):
    """`model` (fp32) with every weight the int4 format covers replaced by its dequantised int4."""
    with torch.no_grad():
        for _, module in quantized_targets(model):
            for p in [module.weight] if isinstance(module, torch.nn.Linear) else [module.gate_up_proj, module.down_proj]:
                p.copy_(dequantize(**quantize_rtn(p, G)))
    return model


@pytest.mark.parametrize("model_type", ["sdar", "sdar_moe", "llada2_moe", "Fast_dLLM_Qwen"])
def test_int4_family_folder_loads_and_matches(tmp_path, model_type, capsys):
    src, dst = tmp_path / "src", tmp_path / "int4"
    write_family(src, model_type)
    assert main(["quantize", "--model", str(src), "--out", str(dst), "--group-size", str(G)]) == 0
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "clover_int4" and cfg["architectures"]
    fp32 = load_family(src, dtype=torch.float32).model
    q = load_family(dst, dtype=torch.float32).model
    layer = q.model.layers[-1]
    attn = layer.self_attn.q_proj if hasattr(layer, "self_attn") else layer.attention.query_key_value
    assert isinstance(attn, Int4Linear)
    assert isinstance(getattr(layer.mlp, "experts", None) or layer.mlp.down_proj, (Int4Experts, Int4Linear))
    ref_attn = dict(fp32.named_modules())[dict((m, n) for n, m in q.named_modules())[attn]]
    assert torch.equal(attn.stored()[0], quantize_rtn(ref_attn.weight.detach(), G)["qweight"])
    ids = torch.randint(4, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, :3] = True  # left padding, odd lengths
    with torch.no_grad():
        exact = fp32(ids, block_size=4, pad=pad)
        fast = q(ids, block_size=4, pad=pad)
        set_int4_kernel(q, "reference")
        ref = q(ids, block_size=4, pad=pad)
        want = dequantised(fp32)(ids, block_size=4, pad=pad)
    real = ~pad
    torch.testing.assert_close(ref[real], want[real], rtol=1e-5, atol=1e-5)
    assert rel(fast[real], ref[real]) < 0.1  # the kernel's bf16 activations
    assert rel(fast[real], exact[real]) < 0.5  # 4-bit weights of a tiny random model: within their rounding


def test_cli_generate_on_an_int4_family_folder(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "int4"
    write_family(src, "sdar_moe")
    run = _clover("quantize", str(src), str(dst), "--group-size", str(G), "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["quantized_params"] > 0
    run = _clover("generate", "--model", str(dst), "--prompt", "Hello", "--max-new-tokens", "7", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["finish_reason"] in ("length", "stop")
    run = _clover("quantize", str(src), str(tmp_path / "g"), "--method", "gptq")
    assert run.returncode == 2 and "--method rtn" in run.stderr and len(run.stderr.strip().splitlines()) == 1
