"""`clover convert`: tiny random transformers checkpoints (both layouts, per-expert and fused experts,
with and without the multimodal prefix, sharded) convert, load, and match transformers' AR logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_5_moe import (
    Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeTextConfig,
)

from clover.cli import main
from clover.convert.mapping import diffusion_additions
from clover.models import CloverConfig, CloverForBlockDiffusion

VOCAB = 128
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32,
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=1, spatial_merge_size=1)


def _random(model):
    """transformers leaves RMSNorm weights at zero and more at constants: randomise all so parity can fail."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval()


def _tokenizer(folder, n):
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, n)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>",
                            chat_template="{{ messages[0]['content'] }}").save_pretrained(folder)


def _rewrite(folder, edit):
    """Load every tensor, apply `edit`, store back as one model.safetensors (drops the index)."""
    files = sorted(folder.glob("*.safetensors"))
    sd = {k: v for f in files for k, v in load_file(f).items()}
    for f in files:
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(edit(sd), folder / "model.safetensors", metadata={"format": "pt"})


def _fuse_experts(sd):
    """Per-expert tensors (what save_pretrained writes) -> fused gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    for layer in {k.split(".experts.")[0] for k in sd if ".experts." in k}:
        e = range(TEXT["num_experts"])
        out[layer + ".experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{layer}.experts.{j}.gate_proj.weight"], sd[f"{layer}.experts.{j}.up_proj.weight"]]) for j in e])
        out[layer + ".experts.down_proj"] = torch.stack([sd[f"{layer}.experts.{j}.down_proj.weight"] for j in e])
    return out


def _multimodal_prefix(sd):
    out = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in sd.items()}
    out["mtp.fc.weight"] = torch.randn(64, 128)  # an MTP head, to be skipped
    return out


def _build(kind, folder, tokenizer_size=None, fused=False, prefix=False, shard=None, tied=False):
    torch.manual_seed(1)
    if kind == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**TEXT))
    elif kind == "qwen3_5_moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TEXT, tie_word_embeddings=tied))
    else:
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION))
    _random(model).save_pretrained(folder, max_shard_size=shard or "5GB")
    if fused or prefix:
        _rewrite(folder, lambda sd: _multimodal_prefix(_fuse_experts(sd) if fused else sd) if prefix else _fuse_experts(sd))
    if tokenizer_size:
        _tokenizer(folder, tokenizer_size)
    return model


def _convert(capsys, *args):
    rc = main(["convert", *map(str, args), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


CASES = {
    # kind, source options, mask expectation
    "next-per_expert-sharded-tokenizer": ("qwen3_next", dict(tokenizer_size=100, shard="100KB")),
    "next-fused-prefix-mtp": ("qwen3_next", dict(fused=True, prefix=True)),
    "qwen3_5-fused-no_tokenizer": ("qwen3_5_moe", dict(fused=True)),
    "qwen3_5-tied_embeddings": ("qwen3_5_moe", dict(tied=True)),
    "qwen3_5_vl-per_expert-prefix-sharded-full_tokenizer": ("qwen3_5_moe_vl", dict(tokenizer_size=VOCAB, shard="100KB")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_conversion_parity(case, tmp_path, capsys):
    kind, opts = CASES[case]
    src, dst = tmp_path / "src", tmp_path / "out" / "clover"
    ref = _build(kind, src, **opts)
    summary = _convert(capsys, src, dst, "--max-shard-size", "300KB")

    model, info = CloverForBlockDiffusion.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.model_type == "clover" and len(summary["shards"]) > 1
    assert (dst / "model.safetensors.index.json").is_file()
    assert all((dst / f).stat().st_size < 300_000 + 20_000 for f in summary["shards"])  # + header
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = model(ids).logits[..., :VOCAB]
    assert (got - want).abs().max().item() < 1e-4

    mask = model.config.mask_token_id
    assert summary["mask_token_id"] == mask
    tokenizer_size = opts.get("tokenizer_size")
    if tokenizer_size:
        tok = AutoTokenizer.from_pretrained(dst)
        assert tok.mask_token == "<|mask|>" and tok.mask_token_id == mask == tokenizer_size
        assert tok.chat_template  # the other tokenizer files came along
    else:
        assert mask == VOCAB
    grown = mask >= VOCAB
    assert model.config.vocab_size == (192 if grown else VOCAB)
    if grown:  # new rows start at the mean embedding
        emb = model.get_input_embeddings().weight
        assert torch.allclose(emb[mask], emb[:VOCAB].mean(0), atol=1e-6)
    if opts.get("prefix") or kind == "qwen3_5_moe_vl":
        assert summary["skipped"] == ({"mtp": 1} if opts.get("prefix") else {"model.visual": summary["skipped"]["model.visual"]})
    assert sorted(p.name for p in dst.parent.iterdir()) == ["clover"]  # no temp folder left behind


def test_streams_layer_by_layer(tmp_path, monkeypatch):
    """Each source tensor is read once, and a layer's tensors all before the next layer's."""
    from clover.convert import convert as conv

    _build("qwen3_next", tmp_path / "src", shard="100KB")
    reads = []
    get = conv.SafetensorsSource.get
    monkeypatch.setattr(conv.SafetensorsSource, "get", lambda self, key: reads.append(key) or get(self, key))
    conv.convert_checkpoint(tmp_path / "src", tmp_path / "dst", progress=False)
    assert len(reads) == len(set(reads))
    layers = [int(k.split(".")[2]) for k in reads if k.startswith("model.layers.")]
    assert layers == sorted(layers)


def test_diffusion_additions_match_model_init():
    cfg = CloverConfig(**{k: v for k, v in TEXT.items()})
    model = CloverForBlockDiffusion(cfg)
    sd = model.state_dict()
    for i in range(cfg.num_hidden_layers):
        for name, value in diffusion_additions(cfg, i).items():
            assert torch.equal(sd[name], value), name


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base") / "src"
    _build("qwen3_5_moe", folder)
    return folder


def _missing(folder):
    _rewrite(folder, lambda sd: {k: v for k, v in sd.items() if k != "model.layers.1.linear_attn.A_log"})


def _wrong_shape(folder):
    _rewrite(folder, lambda sd: {**sd, "model.layers.0.mlp.gate.weight": torch.zeros(7, 64)})


def _per_expert_shape(folder):
    _rewrite(folder, lambda sd: {**sd, "model.layers.2.mlp.experts.5.up_proj.weight": torch.zeros(32, 60)})


def _unsupported(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("mutate, message", [
    (_missing, "missing tensor model.layers.1.linear_attn.A_log"),
    (_wrong_shape, "model.layers.0.mlp.gate.weight"),
    (_per_expert_shape, "wrong shape for model.layers.2.mlp.experts.5.up_proj.weight: (32, 60)"),
    (_unsupported, "unsupported architecture LlamaForCausalLM"),
])
def test_bad_source_is_one_line_error(base, tmp_path, capsys, mutate, message):
    src, dst = tmp_path / "src", tmp_path / "out" / "clover"
    shutil.copytree(base, src)
    mutate(src)
    assert main(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    assert not dst.exists()
    assert not dst.parent.exists() or not list(dst.parent.iterdir())


def test_existing_dst_needs_force(base, tmp_path, capsys):
    dst = tmp_path / "clover"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert main(["convert", str(base), str(dst)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (dst / "keep.txt").read_text() == "mine"
    summary = _convert(capsys, base, dst, "--force", "--dtype", "bf16")
    assert summary["shards"] == ["model.safetensors"] and not (dst / "keep.txt").exists()
    assert CloverForBlockDiffusion.from_pretrained(dst).dtype == torch.bfloat16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clover"]


def test_mask_token_id_flag_keeps_vocab(base, tmp_path, capsys):
    summary = _convert(capsys, base, tmp_path / "clover", "--mask-token-id", "5")
    assert summary["mask_token_id"] == 5 and summary["vocab_size"] == VOCAB
    assert CloverConfig.from_pretrained(tmp_path / "clover").mask_token_id == 5
