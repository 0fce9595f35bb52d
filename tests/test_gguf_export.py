"""clover export-gguf: tensor layout, metadata and diffusion keys of the written GGUF (no llama.cpp
build needed; tests/test_llamacpp.py runs the files in llama.cpp)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from clover.backends.gguf_export import export_gguf, read_diffusion_extras  # noqa: E402
from clover.models import CloverConfig, CloverForBlockDiffusion  # noqa: E402

DEFAULT = Path(__file__).resolve().parent.parent / "clover" / "assets" / "default"

# odd dims everywhere llama.cpp allows them (it needs linear_key_head_dim == linear_value_head_dim)
ODD = dict(vocab_size=4096, hidden_size=96, num_hidden_layers=5,
           layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
           num_attention_heads=3, num_key_value_heads=1, head_dim=20, partial_rotary_factor=0.3,
           linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=24, linear_value_head_dim=24,
           num_experts=5, num_experts_per_tok=2, moe_intermediate_size=40, shared_expert_intermediate_size=56,
           max_position_embeddings=512, block_size=8, mask_token_id=1, eos_token_id=[0, 3], pad_token_id=8)


def save_odd_model(folder: Path, seed: int = 0, trained_extras: bool = True) -> Path:
    """A random model with odd dims and the shipped tokenizer; norms and diffusion extras non-zero."""
    torch.manual_seed(seed)
    model = CloverForBlockDiffusion(CloverConfig(**ODD))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or (trained_extras and ("right_conv" in name or "block_calibration" in name)):
                p.normal_(0, 0.1)
        model.lm_head.weight.mul_(20)  # peaked logits, as a trained model has
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT / f, folder / f)
    return folder


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    folder = save_odd_model(tmp_path_factory.mktemp("odd"))
    out = folder / "model-f32.gguf"
    export_gguf(folder, out, "f32")
    return folder, out


def tensors(path) -> dict[str, np.ndarray]:
    reader = gguf.GGUFReader(str(path))
    return {t.name: np.asarray(t.data) for t in reader.tensors}


def test_tensor_layout_matches_clover_weights(odd):
    folder, path = odd
    model = CloverForBlockDiffusion.from_pretrained(folder)
    cfg = model.config
    t = tensors(path)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert np.array_equal(t["token_embd.weight"], sd["model.embed_tokens.weight"])
    assert np.allclose(t["output_norm.weight"], 1 + sd["model.norm.weight"])
    H, D, KV = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    # attention layer 1: llama.cpp reads each head's 2D outputs as [q_h ; gate_h]
    qkv = sd["model.layers.1.self_attn.qkv_proj.weight"]
    q_rows = t["blk.1.attn_q.weight"].reshape(H, 2, D, cfg.hidden_size)
    for h in range(H):
        assert np.array_equal(q_rows[h, 0], qkv[h * D : (h + 1) * D])
        assert np.array_equal(q_rows[h, 1], qkv[H * D + h * D : H * D + (h + 1) * D])
    assert np.array_equal(t["blk.1.attn_v.weight"], qkv[2 * H * D + KV * D :])
    # GDN layer 0: ssm_ba groups [b ; a] per key head; ssm_a = -exp(A_log)
    gdn = "model.layers.0.linear_attn."
    inp = sd[gdn + "in_proj.weight"]
    hv, hk = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    rep = hv // hk
    conv_dim = 2 * hk * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim
    b, a = inp[conv_dim + hv * cfg.linear_value_head_dim :][:hv], inp[-hv:]
    ba = t["blk.0.ssm_ba.weight"].reshape(hk, 2 * rep, cfg.hidden_size)
    for g in range(hk):
        assert np.array_equal(ba[g, :rep], b[g * rep : (g + 1) * rep])
        assert np.array_equal(ba[g, rep:], a[g * rep : (g + 1) * rep])
    assert np.allclose(t["blk.0.ssm_a"], -np.exp(sd[gdn + "A_log"]))
    assert np.array_equal(t["blk.0.ssm_conv1d.weight"], sd[gdn + "conv1d.weight"][:, 0])
    gu = sd["model.layers.0.mlp.experts.gate_up_proj"]
    assert np.array_equal(t["blk.0.ffn_up_exps.weight"], gu[:, cfg.moe_intermediate_size :])
    # the full-attention layers carry no GDN tensors and vice versa
    assert "blk.1.ssm_a" not in t and "blk.0.attn_q.weight" not in t


def test_metadata_and_diffusion_keys(odd):
    folder, path = odd
    cfg = CloverConfig.from_pretrained(folder)
    reader = gguf.GGUFReader(str(path))
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == "qwen3next"
    assert field("qwen3next.attention.recurrent_layers") == [k == "linear_attention" for k in cfg.layer_types]
    assert field("qwen3next.rope.dimension_count") == cfg.rotary_dim
    assert field("qwen3next.ssm.time_step_rank") == cfg.linear_num_value_heads
    assert field("tokenizer.ggml.pre") == "smollm" and field("tokenizer.ggml.eos_token_id") == 0
    assert "im_start" in field("tokenizer.chat_template")
    extras = read_diffusion_extras(path)
    assert extras["mask_token_id"] == cfg.mask_token_id and extras["block_size"] == cfg.block_size
    model = CloverForBlockDiffusion.from_pretrained(folder)
    for i in (0, 2, 3):
        layer = model.model.layers[i].linear_attn
        assert np.array_equal(extras[f"blk.{i}.right_conv"], layer.right_conv.detach().numpy())
        assert np.array_equal(extras[f"blk.{i}.block_calibration"], layer.block_calibration.detach().numpy())
        assert np.array_equal(extras[f"blk.{i}.bidir_log_scale"], layer.bidir_log_scale.detach().numpy())
    assert not any(k.startswith("blk.1.") for k in extras)


@pytest.mark.parametrize("outtype, expect", [("bf16", "BF16"), ("q8_0", "Q8_0"), ("q4_0", "Q4_0")])
def test_outtypes(odd, tmp_path, outtype, expect):
    folder, f32 = odd
    out = tmp_path / f"m-{outtype}.gguf"
    summary = export_gguf(folder, out, outtype)
    reader = gguf.GGUFReader(str(out))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.ssm_conv1d.weight"] == "F32" and kinds["blk.0.attn_norm.weight"] == "F32"
    # rows of 96 (hidden) split into 32-wide quant blocks; rows of 40 (expert), 72 (GDN values) do not
    # and fall back to bf16
    assert kinds["blk.0.attn_qkv.weight"] == expect and kinds["token_embd.weight"] == expect
    assert kinds["blk.0.ffn_down_exps.weight"] == "BF16" and kinds["blk.0.ssm_out.weight"] == "BF16"
    assert summary["tensor_types"][expect] >= 10
    ref = tensors(f32)["blk.0.ssm_out.weight"]
    back = gguf.quants.dequantize(next(t for t in reader.tensors if t.name == "blk.0.ssm_out.weight").data,
                                  gguf.GGMLQuantizationType.BF16)
    assert np.abs(back - ref).max() <= np.abs(ref).max() / 100


def test_default_model_quantises_its_matrices(tmp_path):
    out = tmp_path / "default-q4_0.gguf"
    summary = export_gguf(DEFAULT, out, "q4_0")
    assert summary["tensor_types"] == {"Q4_0": 42, "F32": 31}  # every matrix of the 256-wide model splits


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "clover", "export-gguf", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_errors_are_one_line(tmp_path, odd):
    folder, path = odd
    r = run_cli(str(tmp_path / "missing"), str(tmp_path / "x.gguf"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no config.json" in r.stderr
    r = run_cli(str(folder), str(path))
    assert r.returncode == 2 and "exists" in r.stderr and r.stderr.count("\n") == 1
    r = run_cli(str(folder), str(tmp_path / "x.bin"))
    assert r.returncode == 2 and ".gguf" in r.stderr
    bad = tmp_path / "bad"
    torch.manual_seed(0)
    CloverForBlockDiffusion(CloverConfig(**{**ODD, "linear_value_head_dim": 16})).save_pretrained(bad)
    r = run_cli(str(bad), str(tmp_path / "bad.gguf"))
    assert r.returncode == 2 and "linear_key_head_dim == linear_value_head_dim" in r.stderr
    assert not (tmp_path / "bad.gguf").exists() and not list(tmp_path.glob(".bad.gguf*"))


def test_cli_writes_file(tmp_path, odd):
    folder, _ = odd
    r = run_cli(str(folder), str(tmp_path / "m.gguf"), "--outtype", "q8_0", "--json")
    assert r.returncode == 0, r.stderr
    assert '"outtype": "q8_0"' in r.stdout and (tmp_path / "m.gguf").stat().st_size > 0
    assert not list(tmp_path.glob(".m.gguf*"))
