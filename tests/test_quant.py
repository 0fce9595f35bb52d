"""INT4 quantisation: stored format, kernels vs the dequantised reference, GPTQ vs RTN, checkpoints
that load transparently, bad input rejected before anything is written, the memory plan."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from clover.cli import main as cli
from clover.engine import DecodeConfig, Engine
from clover.models import CloverForBlockDiffusion, preset_config
from clover.sizes import int4_memory_plan
from clover.ops.moe import grouped_experts
from clover.quant import Int4Experts, Int4Linear, dequantize, pack_int4, quantize_rtn, set_int4_kernel, unpack_int4
from clover.convert.quantize import quantize_checkpoint
from clover.models.modeling_clover import CloverExperts
from clover.quant.gptq import Hessian, gptq_quantize, output_error
from clover.quant.int4 import clover_kernel_available, cpu_kernel_available
from clover.quant.modules import DEFAULT_NOT_QUANTIZED, Int4Weight, quantized_targets

G = 32  # clover-tiny's smallest input dimension is 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random clover-tiny checkpoint with a word-level tokenizer, and a calibration file."""
    root = tmp_path_factory.mktemp("quant")
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(preset_config("clover-tiny", eos_token_id=1)).eval()
    with torch.no_grad():  # peaked predictions; trained-looking (non-zero) norm weights
        model.lm_head.weight.mul_(40)
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(root / "src")
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 127)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>").save_pretrained(root / "src")
    lines = [json.dumps({"text": " ".join(f"w{(i * 7 + j * j) % 120 + 2}" for j in range(48))}) for i in range(40)]
    (root / "calib.jsonl").write_text("\n".join(lines) + "\n")
    return root, model


# ------------------------------------------------------------------------------------------------
# Format and kernels
# ------------------------------------------------------------------------------------------------
def test_pack_unpack_round_trip():
    q = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(packed[0, 0, 0], q[0, 0, 0] | (q[0, 0, 1] << 4))  # low nibble = even column
    w = torch.randn(48, 128)
    stored = quantize_rtn(w, 64)
    assert torch.equal(pack_int4(unpack_int4(stored["qweight"])), stored["qweight"])


def test_rtn_error_is_within_a_step():
    """Rounding costs <= half a step; the integer zero point may shift the grid by half a step more
    at the edges of a group's range."""
    w = torch.randn(40, 256) * 0.05
    stored = quantize_rtn(w, 64)
    step = stored["scales"].float().repeat_interleave(64, dim=1)
    err = (dequantize(**stored) - w).abs()
    assert (err <= step + 1e-6).all() and (err / step).mean() < 0.3


@pytest.mark.skipif(not cpu_kernel_available(), reason="torch has no CPU int4pack kernel")
@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("n", [64, 200])  # 200: not a multiple of 16, padded for the CPU kernels
@pytest.mark.parametrize("kernel", ["auto", "aten"])
def test_int4_linear_equals_dequantised_reference(rows, n, kernel):
    k = 128
    layer = Int4Linear.from_float(torch.randn(n, k) * 0.05, G, bias=torch.randn(n))
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    ref = F.linear(x.float(), dequantize(layer.qweight, layer.scales, layer.qzeros), layer.bias.float())
    layer.set_kernel("reference")
    torch.testing.assert_close(layer(x).float(), ref, atol=0.02, rtol=0.02)
    layer.set_kernel(kernel)
    y = layer(x)
    want = "cpu" if kernel == "aten" or not clover_kernel_available() else "clover"
    assert layer._packed is not None and layer._packed[0].kind == want  # that kernel ran
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    torch.testing.assert_close(y.float(), ref, atol=0.02, rtol=0.02)
    torch.testing.assert_close(layer(x.float()), ref, atol=0.02, rtol=0.02)  # fp32 in -> fp32 out


@pytest.mark.parametrize("tokens", [1, 13])
def test_int4_experts_equal_grouped_experts_on_dequantised_weights(tokens):
    e, h, i = 8, 64, 32
    experts = Int4Experts(e, h, i, G)
    gu, dn = torch.randn(e, 2 * i, h) * 0.1, torch.randn(e, h, i) * 0.1
    experts.gate_up_proj.load_stored(quantize_rtn(gu, G))
    experts.down_proj.load_stored(quantize_rtn(dn, G))
    x = torch.randn(tokens, h, dtype=torch.bfloat16)
    top_w, top_idx = torch.rand(tokens, e).softmax(-1).topk(2, dim=-1)
    ref = grouped_experts(x.float(), top_idx, top_w.float(), dequantize(*experts.gate_up_proj.stored()),
                          dequantize(*experts.down_proj.stored()))
    torch.testing.assert_close(experts(x, top_idx, top_w.to(x.dtype)).float(), ref, atol=0.03, rtol=0.03)


def test_state_dict_survives_the_kernel_layout():
    """On CPU the kernel layout replaces the stored copy; state_dict and .to() still give it back."""
    w = Int4Weight.from_float(torch.randn(3, 48, 64), G)
    before = {k: v.clone() for k, v in w.state_dict().items()}
    w.matmul(torch.randn(2, 64), 1)
    after = w.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    w.to(torch.float32)
    assert w.qweight.shape == (3, 48, 32) and torch.equal(w.qweight, before["qweight"])


# ------------------------------------------------------------------------------------------------
# GPTQ
# ------------------------------------------------------------------------------------------------
def _layer_inputs(model, name, ids):
    seen = []
    handle = model.get_submodule(name).register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    with torch.no_grad():
        model(ids, block_size=8, draft_len=8)
    handle.remove()
    return torch.cat([s.reshape(-1, s.shape[-1]) for s in seen])


@pytest.mark.parametrize("name", ["model.layers.0.linear_attn.in_proj", "model.layers.3.self_attn.o_proj",
                                  "model.layers.1.mlp.shared_expert.down_proj"])
def test_gptq_reconstruction_error_at_most_rtn(ckpt, name):
    _, model = ckpt
    ids = torch.randint(0, 120, (4, 64), generator=torch.Generator().manual_seed(1))
    x = _layer_inputs(model, name, ids)
    w = model.get_submodule(name).weight.detach()
    h = Hessian(w.shape[1])
    h.add(x)
    err_gptq = output_error(w, dequantize(**gptq_quantize(w, h, G)), x)
    err_rtn = output_error(w, dequantize(**quantize_rtn(w, G)), x)
    assert err_gptq <= err_rtn
    assert err_gptq < 0.9 * err_rtn  # and by a margin, on these correlated inputs


def test_gptq_without_inputs_is_rtn():
    w = torch.randn(32, 64)
    assert torch.equal(gptq_quantize(w, Hessian(64), G)["qweight"], quantize_rtn(w, G)["qweight"])


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rtn_ckpt(ckpt):
    root, _ = ckpt
    quantize_checkpoint(root / "src", root / "rtn", group_size=G, method="rtn", notice=lambda m: None)
    return root / "rtn"


def test_quantized_checkpoint_loads_and_generates(ckpt, rtn_ckpt, tmp_path):
    _, model = ckpt
    cfg = json.loads((rtn_ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "clover_int4" and cfg["quantization_config"]["group_size"] == G
    q = CloverForBlockDiffusion.from_pretrained(rtn_ckpt).eval()
    layer = q.model.layers[0]
    assert isinstance(layer.mlp.experts, Int4Experts) and isinstance(layer.linear_attn.in_proj, Int4Linear)
    assert isinstance(layer.mlp.gate, torch.nn.Linear) and isinstance(q.lm_head, torch.nn.Linear)  # kept
    assert q.dtype == torch.bfloat16
    torch.testing.assert_close(q.model.layers[1].mlp.experts.down_proj.qweight,
                               quantize_rtn(model.model.layers[1].mlp.experts.down_proj.detach(), G)["qweight"])
    ids = torch.randint(0, 120, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fast = q(ids, block_size=8, draft_len=8).logits.float()
        set_int4_kernel(q, "reference")
        ref = q(ids, block_size=8, draft_len=8).logits.float()
        set_int4_kernel(q, "auto")
    assert (fast - ref).abs().max() < 0.05 * ref.abs().max()
    out = Engine(q, DecodeConfig(block_size=8, max_new_tokens=16)).generate([[5, 6, 7], [9]])
    assert [len(s.token_ids) for s in out] == [16, 16]
    assert all(0 <= t < q.config.vocab_size for s in out for t in s.token_ids)
    q.save_pretrained(tmp_path / "again")  # after the kernels replaced the stored copy
    again, first = load_file(tmp_path / "again" / "model.safetensors"), load_file(rtn_ckpt / "model.safetensors")
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def test_gptq_checkpoint_via_cli(ckpt, rtn_ckpt, capsys):
    root, _ = ckpt
    dst = root / "gptq"
    rc = cli(["quantize", str(root / "src"), str(dst), "--method", "gptq", "--group-size", "32", "--calib",
              str(root / "calib.jsonl"), "--calib-samples", "4", "--calib-seq-len", "48", "--quantize-head", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["method"] == "gptq" and summary["quantized_bytes"] <= 0.30 * summary["src_bytes_quantized"]
    q = CloverForBlockDiffusion.from_pretrained(dst).eval()
    assert isinstance(q.lm_head, Int4Linear)
    qc = q.config.quantization_config
    assert qc["method"] == "gptq" and qc["calibration"]["samples"] == 4 and "lm_head" not in qc["modules_not_quantized"]
    with torch.no_grad():
        assert torch.isfinite(q(torch.tensor([[3, 4, 5, 6]])).logits).all()


def test_int8_activations_are_a_property_of_the_checkpoint(ckpt, rtn_ckpt, capsys):
    """`clover quantize --activations int8` records it in quantization_config; loading puts every int4
    layer on the int4 x int8 kernel (its outputs near the exact-activation reference); a bad value is refused."""
    root, _ = ckpt
    dst = root / "rtn-int8"
    assert cli(["quantize", str(root / "src"), str(dst), "--group-size", "32", "--activations", "int8", "--json"]) == 0
    capsys.readouterr()
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["activations"] == "int8"
    assert json.loads((rtn_ckpt / "config.json").read_text())["quantization_config"]["activations"] == "float32"
    q = CloverForBlockDiffusion.from_pretrained(dst).eval()
    layers = [m for m in q.modules() if isinstance(m, Int4Weight)]
    assert layers and {m.kernel for m in layers} == {"int8"}
    ids = torch.randint(0, 120, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fast = q(ids, block_size=8, draft_len=8).logits.float()
        set_int4_kernel(q, "reference")
        ref = q(ids, block_size=8, draft_len=8).logits.float()
    assert (fast - ref).abs().max() < 0.05 * ref.abs().max()
    cfg["quantization_config"]["activations"] = "int3"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="activations must be one of float32, int8"):
        CloverForBlockDiffusion.from_pretrained(dst)


def _cli_fails(args, capsys, match):
    rc = cli(["quantize", *args])
    err = capsys.readouterr().err
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1, err


def test_bad_input_is_a_clear_error_and_writes_nothing(ckpt, rtn_ckpt, capsys):
    root, _ = ckpt
    before = sorted(p.name for p in root.iterdir())
    src, dst = str(root / "src"), str(root / "bad")
    _cli_fails([src, dst, "--group-size", "64"], capsys, "does not divide the input dimension 32")
    _cli_fails([str(rtn_ckpt), dst], capsys, "already quantised")
    _cli_fails([src, dst, "--group-size", "32", "--method", "gptq", "--calib", str(root / "nope.jsonl")], capsys, "nope.jsonl does not exist")
    _cli_fails([src, str(rtn_ckpt), "--group-size", "32"], capsys, "already exists")
    _cli_fails([str(root / "missing"), dst], capsys, "no config.json")
    assert sorted(p.name for p in root.iterdir()) == before  # no DST, no temporary folder left


# ------------------------------------------------------------------------------------------------
# Memory plan
# ------------------------------------------------------------------------------------------------
def test_memory_plan_of_the_35b_preset():
    plan = int4_memory_plan(preset_config("clover-35b-a3b"), context=32768)
    assert plan["kv_cache_bytes"] == 20480 * 32768 and plan["gdn_state_bytes"] == 64_389_120
    assert plan["quantized_layers_ratio_vs_bf16"] <= 0.30 and plan["weight_ratio_vs_bf16"] < 0.30
    assert not plan["fits"] and 0 < plan["experts_in_host_memory_bytes"] < plan["routed_expert_bytes"]
    assert plan["total_bytes"] - plan["experts_in_host_memory_bytes"] == plan["budget_bytes"]
    small = int4_memory_plan(preset_config("clover-tiny"), group_size=32, context=1024)
    assert small["fits"] and small["experts_in_host_memory_bytes"] == 0


def test_info_cli_quant_json(capsys):
    assert cli(["info", "--preset", "clover-35b-a3b", "--quant", "int4", "--context", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["quant_plan"]["context"] == 4096 and out["quant_plan"]["answer"].startswith("not entirely")


def test_quantized_targets_find_every_experts_module_without_importing_the_model_class():
    """quant/modules.py tells routed experts by their fused shape (it must not import the model file):
    it finds exactly the CloverExperts modules, and every nn.Linear not excluded."""
    model = CloverForBlockDiffusion(preset_config("clover-tiny", eos_token_id=1))
    found = dict(quantized_targets(model, DEFAULT_NOT_QUANTIZED))
    experts = {n for n, m in model.named_modules() if isinstance(m, CloverExperts)}
    assert experts and {n for n, m in found.items() if not isinstance(m, torch.nn.Linear)} == experts
    assert all(isinstance(m, (torch.nn.Linear, CloverExperts)) for m in found.values())
