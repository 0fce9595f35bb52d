"""Clover checkpoint -> GGUF for llama.cpp (its `qwen3next` architecture), written with `gguf`.

Block size 1 is exactly the causal LM (docs/architecture.md), so the backbone is written under
llama.cpp's own tensor names and `qwen3next.*` keys and the file runs in **stock** llama.cpp as an
AR model. The layout changes from Clover's fused tensors (the same ones llama.cpp's own
convert_hf_to_gguf.py makes for Qwen3-Next, read from the pinned sdist):

* zero-centred RMSNorm weights `w` are stored as `1 + w` (llama.cpp multiplies by the weight);
  the GDN gated norm is not zero-centred and is stored as is;
* attention `qkv_proj` rows `[q ; gate ; k ; v]` -> `attn_q` with per-head `[q_h ; gate_h]` rows
  (llama.cpp splits each head's 2*D outputs), `attn_k`, `attn_v`;
* GDN `in_proj` rows `[q ; k ; v ; z ; b ; a]` -> `attn_qkv` (`[q ; k ; v]`, value heads in
  Clover's order: value head j reads key head j // (Hv/Hk), the repeat-interleave pairing
  llama.cpp's qwen3next graph uses; its qwen35 graph tiles instead and would need the value heads
  permuted), `attn_gate` (z) and `ssm_ba` with per-key-head groups `[b_g ; a_g]` (Qwen3-Next's
  interleaved layout, which the qwen3next graph reshapes);
* `A_log` -> `ssm_a = -exp(A_log)`, `dt_bias` -> `ssm_dt.bias`, `conv1d` squeezed to [C, K];
* fused experts `gate_up_proj [E, 2I, H]` -> `ffn_gate_exps`, `ffn_up_exps`; shared expert the same.

The block-diffusion additions (right-conv branch, block-size calibration, bidirectional scale) are
metadata arrays under `clover.*` keys, not tensors: llama.cpp refuses a file with tensors its graph
does not create, and ignores keys it does not know. `read_diffusion_extras` reads them back.

Tokenizer: byte-level BPE (`clover train-tokenizer`) as llama.cpp's `gpt2` model; Clover's
pre-tokenizer (single digits, then the GPT-2 split) is the one llama.cpp calls `smollm`.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..utils.files import written_whole

ARCH = "qwen3next"
OUTTYPES = ("f32", "bf16", "q8_0", "q4_0", "q4_k")
PRE_TOKENIZER = "smollm"  # llama.cpp's name for [\p{N} isolated] then the GPT-2 regex
EXTRA_PREFIX = "clover"  # diffusion keys: clover.mask_token_id, clover.blk.N.right_conv, ...


class ExportError(ValueError):
    """The checkpoint cannot be written as a qwen3next GGUF (reported as one line by the CLI)."""


@dataclass
class Checkpoint:
    folder: Path
    config: object  # CloverConfig
    tensors: dict  # name -> torch.Tensor (fp32)


def load_checkpoint(folder: str | Path) -> Checkpoint:
    import torch
    from safetensors.torch import load_file

    from ..models import CloverConfig

    from ..utils.checkpoint import CheckpointError, check_folder, weight_files

    folder = Path(folder)
    try:  # the checks every command makes: a Clover config.json, every safetensors file whole
        check_folder(folder)
        files = weight_files(folder)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    config = CloverConfig.from_pretrained(folder)
    if getattr(config, "quantization_config", None):
        raise ExportError(f"{folder}: an int4 checkpoint (clover quantize); export the full-precision model "
                          "and pick --outtype q4_0 / q4_k instead")
    tensors = {}
    for f in files:
        tensors.update({k: v.to(torch.float32) for k, v in load_file(str(f)).items()})
    if "lm_head.weight" not in tensors:  # tied head
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return Checkpoint(folder, config, tensors)


def check_supported(config) -> None:
    """What llama.cpp's qwen3next graph cannot express, as one clear error."""
    need = [
        (config.linear_key_head_dim == config.linear_value_head_dim, "llama.cpp's qwen3next needs "
         f"linear_key_head_dim == linear_value_head_dim (got {config.linear_key_head_dim}, {config.linear_value_head_dim})"),
        (config.norm_topk_prob, "llama.cpp's qwen3next always renormalises the top-k router weights (norm_topk_prob=false)"),
        (config.shared_expert_intermediate_size > 0, "llama.cpp's qwen3next needs a shared expert "
         "(shared_expert_intermediate_size=0)"),
    ]
    for ok, why in need:
        if not ok:
            raise ExportError(why)


# ------------------------------------------------------------------------------------------------
# Tensors: Clover names/layout -> llama.cpp qwen3next names/layout
# ------------------------------------------------------------------------------------------------
def _attn_q_rows(w, heads: int, head_dim: int):
    """[q (H*D) ; gate (H*D)] rows -> per head [q_h ; gate_h] (what llama.cpp's graph splits)."""
    q, gate = w[: heads * head_dim], w[heads * head_dim : 2 * heads * head_dim]
    tail = w.shape[1:]
    return np.stack([q.reshape(heads, head_dim, *tail), gate.reshape(heads, head_dim, *tail)], axis=1).reshape(
        2 * heads * head_dim, *tail)


def _ba_rows(b, a, k_heads: int):
    """b, a rows [Hv, ...] -> per key head [b_g (Hv/Hk) ; a_g (Hv/Hk)]."""
    rep = b.shape[0] // k_heads
    tail = b.shape[1:]
    return np.concatenate([b.reshape(k_heads, rep, *tail), a.reshape(k_heads, rep, *tail)], axis=1).reshape(
        2 * b.shape[0], *tail)


def backbone_tensors(ckpt: Checkpoint):
    """(gguf name, fp32 numpy array) for every tensor llama.cpp's qwen3next graph creates."""
    c, t = ckpt.config, ckpt.tensors

    def get(name):
        return t[name].numpy()

    yield "token_embd.weight", get("model.embed_tokens.weight")
    yield "output_norm.weight", get("model.norm.weight") + 1.0
    yield "output.weight", get("lm_head.weight")
    kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    conv_dim = 2 * kd + vd
    for i, kind in enumerate(c.layer_types):
        p, blk = f"model.layers.{i}.", f"blk.{i}."
        yield blk + "attn_norm.weight", get(p + "input_layernorm.weight") + 1.0
        yield blk + "post_attention_norm.weight", get(p + "post_attention_layernorm.weight") + 1.0
        if kind == "full_attention":
            a = p + "self_attn."
            hd, qd, kvd = c.head_dim, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            w = get(a + "qkv_proj.weight")
            yield blk + "attn_q.weight", _attn_q_rows(w, c.num_attention_heads, hd)
            yield blk + "attn_k.weight", w[2 * qd : 2 * qd + kvd]
            yield blk + "attn_v.weight", w[2 * qd + kvd :]
            if c.attention_bias:
                bias = get(a + "qkv_proj.bias")
                yield blk + "attn_q.bias", _attn_q_rows(bias, c.num_attention_heads, hd)
                yield blk + "attn_k.bias", bias[2 * qd : 2 * qd + kvd]
                yield blk + "attn_v.bias", bias[2 * qd + kvd :]
                yield blk + "attn_output.bias", get(a + "o_proj.bias")
            yield blk + "attn_q_norm.weight", get(a + "q_norm.weight") + 1.0
            yield blk + "attn_k_norm.weight", get(a + "k_norm.weight") + 1.0
            yield blk + "attn_output.weight", get(a + "o_proj.weight")
        else:
            g = p + "linear_attn."
            w = get(g + "in_proj.weight")
            hv = c.linear_num_value_heads
            yield blk + "attn_qkv.weight", w[:conv_dim]
            yield blk + "attn_gate.weight", w[conv_dim : conv_dim + vd]
            yield blk + "ssm_ba.weight", _ba_rows(w[conv_dim + vd : conv_dim + vd + hv], w[conv_dim + vd + hv :],
                                                  c.linear_num_key_heads)
            yield blk + "ssm_conv1d.weight", get(g + "conv1d.weight")[:, 0, :]
            yield blk + "ssm_dt.bias", get(g + "dt_bias")
            yield blk + "ssm_a", -np.exp(get(g + "A_log"))
            yield blk + "ssm_norm.weight", get(g + "norm.weight")
            yield blk + "ssm_out.weight", get(g + "out_proj.weight")
        m = p + "mlp."
        inter = c.moe_intermediate_size
        gate_up = get(m + "experts.gate_up_proj")
        yield blk + "ffn_gate_inp.weight", get(m + "gate.weight")
        yield blk + "ffn_gate_exps.weight", gate_up[:, :inter]
        yield blk + "ffn_up_exps.weight", gate_up[:, inter:]
        yield blk + "ffn_down_exps.weight", get(m + "experts.down_proj")
        si = c.shared_expert_intermediate_size
        shared = get(m + "shared_expert.gate_up_proj.weight")
        yield blk + "ffn_gate_inp_shexp.weight", get(m + "shared_expert_gate.weight")[0]
        yield blk + "ffn_gate_shexp.weight", shared[:si]
        yield blk + "ffn_up_shexp.weight", shared[si:]
        yield blk + "ffn_down_shexp.weight", get(m + "shared_expert.down_proj.weight")


def diffusion_extras(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """The block-diffusion parameters per GDN layer (key suffix -> fp32 array)."""
    c, t = ckpt.config, ckpt.tensors
    out = {}
    for i, kind in enumerate(c.layer_types):
        if kind != "full_attention":
            g = f"model.layers.{i}.linear_attn."
            out[f"blk.{i}.right_conv"] = t[g + "right_conv"].numpy()  # [conv_dim, K-1]
            out[f"blk.{i}.block_calibration"] = t[g + "block_calibration"].numpy()  # [anchors, Hv]
            out[f"blk.{i}.bidir_log_scale"] = t[g + "bidir_log_scale"].numpy()  # [Hv]
    return out


# ------------------------------------------------------------------------------------------------
# Tensor types
# ------------------------------------------------------------------------------------------------
_ALWAYS_F32 = ("_norm.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ffn_gate_inp.weight",
               "ffn_gate_inp_shexp.weight", ".bias")


def tensor_type(name: str, array: np.ndarray, outtype: str):
    """(GGMLQuantizationType, numpy data to write) for one tensor at the requested --outtype. Norms,
    the conv kernel, decay parameters and routers stay f32 (as llama.cpp's converter keeps them);
    a matrix whose rows do not split into 32-wide quant blocks falls back to bf16."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if outtype == "f32" or array.ndim == 1 or name.endswith(_ALWAYS_F32):
        return Q.F32, np.ascontiguousarray(array, dtype=np.float32)
    qtype = {"bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[outtype]
    if qtype != Q.BF16 and array.shape[-1] % 32:
        qtype = Q.BF16
    return qtype, quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------
def tokenizer_fields(folder: Path, vocab_size: int) -> dict:
    """tokens / token types / merges / special ids / chat template of a byte-level BPE tokenizer."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{folder}: no tokenizer.json (export-gguf needs the model's byte-level BPE tokenizer)")
    from ..utils.checkpoint import CheckpointError, read_json

    try:
        spec = read_json(path, "a tokenizer.json")
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ExportError(f"{path}: only byte-level BPE tokenizers (clover train-tokenizer) can be written for "
                          f"llama.cpp, this one is {model.get('type')!r}")
    try:
        vocab = {str(text): int(i) for text, i in model["vocab"].items()}
        added = {int(a["id"]): a for a in spec.get("added_tokens", [])}
    except (AttributeError, KeyError, TypeError, ValueError):
        raise ExportError(f"{path}: not a tokenizer.json (its model.vocab or added_tokens is malformed)") from None
    for i, a in added.items():
        vocab[a["content"]] = i
    n = max(vocab_size, max(vocab.values()) + 1)
    if n > vocab_size:
        raise ExportError(f"{path}: the tokenizer has {n} tokens but the model's vocab_size is {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # UNUSED
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = 1  # NORMAL
    for i, a in added.items():
        types[i] = 3 if a.get("special") else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    config = {}
    if (folder / "tokenizer_config.json").is_file():
        try:
            config = read_json(folder / "tokenizer_config.json", "a tokenizer config")
        except CheckpointError as e:
            raise ExportError(str(e)) from None
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")

    def token_id(key):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return vocab.get(value) if isinstance(value, str) else None

    return dict(tokens=tokens, types=types, merges=merges, template=template, eos=token_id("eos_token"),
                pad=token_id("pad_token"), bos=token_id("bos_token"), eot=vocab.get("<|im_end|>"))


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------
def write_metadata(writer, ckpt: Checkpoint, outtype: str) -> None:
    import gguf

    c = ckpt.config
    writer.add_name(ckpt.folder.name or "clover")
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                          "q4_k": gguf.LlamaFileType.MOSTLY_BF16}[outtype])
    hparams = {  # GGUFWriter.add_<name>: value, the qwen3next.* keys llama.cpp reads
        "context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
        "block_count": c.num_hidden_layers, "feed_forward_length": c.moe_intermediate_size,
        "head_count": c.num_attention_heads, "head_count_kv": c.num_key_value_heads,
        "key_length": c.head_dim, "value_length": c.head_dim, "rope_freq_base": float(c.rope_theta),
        "rope_dimension_count": c.rotary_dim, "layer_norm_rms_eps": float(c.rms_norm_eps),
        "expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
        "expert_feed_forward_length": c.moe_intermediate_size,
        "expert_shared_feed_forward_length": c.shared_expert_intermediate_size,
        "ssm_conv_kernel": c.linear_conv_kernel_dim, "ssm_state_size": c.linear_key_head_dim,
        "ssm_group_count": c.linear_num_key_heads, "ssm_time_step_rank": c.linear_num_value_heads,
        "ssm_inner_size": c.linear_value_head_dim * c.linear_num_value_heads,
    }
    for name, value in hparams.items():
        getattr(writer, f"add_{name}")(value)
    # gguf 0.19 on PyPI has no add_recurrent_layers; llama.cpp reads this bool array per layer
    writer.add_array(f"{ARCH}.attention.recurrent_layers", [kind == "linear_attention" for kind in c.layer_types])
    # the block-diffusion side: ignored by stock llama.cpp, read by Clover's runner
    writer.add_uint32(f"{EXTRA_PREFIX}.mask_token_id", int(c.mask_token_id))
    writer.add_uint32(f"{EXTRA_PREFIX}.block_size", int(c.block_size))
    writer.add_uint32(f"{EXTRA_PREFIX}.max_block_size", int(c.max_block_size))
    writer.add_float32(f"{EXTRA_PREFIX}.threshold", 0.95)
    for key, value in diffusion_extras(ckpt).items():
        writer.add_array(f"{EXTRA_PREFIX}.{key}", [float(x) for x in value.reshape(-1)])
        writer.add_array(f"{EXTRA_PREFIX}.{key}.shape", [int(s) for s in value.shape])


def write_tokenizer(writer, ckpt: Checkpoint) -> None:
    tok = tokenizer_fields(ckpt.folder, ckpt.config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    writer.add_add_bos_token(False)
    eos = tok["eos"]
    if eos is None:
        ids = ckpt.config.eos_token_id
        eos = (ids[0] if isinstance(ids, (list, tuple)) and ids else ids)
    if eos is not None:
        writer.add_eos_token_id(int(eos))
    if tok["eot"] is not None:
        writer.add_eot_token_id(int(tok["eot"]))
    if tok["pad"] is not None:
        writer.add_pad_token_id(int(tok["pad"]))
    if tok["bos"] is not None:
        writer.add_bos_token_id(int(tok["bos"]))
    if tok["template"]:
        writer.add_chat_template(tok["template"])


def export_gguf(model_dir: str | Path, out: str | Path, outtype: str = "bf16", lib_dir: str | Path | None = None) -> dict:
    """Write `out` (temp file + rename). q4_k is made by llama.cpp's own quantizer from an f32 file
    (needs the build: `make llamacpp`), the other types by `gguf`. Returns a small summary."""
    import gguf

    if outtype not in OUTTYPES:
        raise ExportError(f"unknown --outtype {outtype!r} (known: {', '.join(OUTTYPES)})")
    out = Path(out)
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent}: no such folder")
    ckpt = load_checkpoint(model_dir)
    check_supported(ckpt.config)
    tokenizer_fields(ckpt.folder, ckpt.config.vocab_size)  # fail on the tokenizer before writing anything
    if outtype == "q4_k":
        from .llamacpp import quantize_file

        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            f32 = Path(tmp) / "f32.gguf"
            export_gguf(model_dir, f32, "f32")
            return quantize_file(f32, out, "q4_k", lib_dir=lib_dir)
    counts: dict[str, int] = {}
    with written_whole(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), ARCH)
        write_metadata(writer, ckpt, outtype)
        write_tokenizer(writer, ckpt)
        for name, array in backbone_tensors(ckpt):
            qtype, data = tensor_type(name, array, outtype)
            writer.add_tensor(name, data, raw_dtype=qtype)  # quantised data: gguf derives the shape from its bytes
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return {"path": str(out), "outtype": outtype, "arch": ARCH, "bytes": out.stat().st_size, "tensor_types": counts}


def read_diffusion_extras(path: str | Path) -> dict:
    """The `clover.*` keys of an exported file: scalars as numbers, arrays reshaped (fp32)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {name: f for name, f in reader.fields.items() if name.startswith(EXTRA_PREFIX + ".")}
    out = {}
    for name, f in fields.items():
        if name.endswith(".shape"):
            continue
        key = name[len(EXTRA_PREFIX) + 1 :]
        value = f.contents()
        if isinstance(value, list):
            shape = fields[name + ".shape"].contents()
            value = np.asarray(value, dtype=np.float32).reshape(shape)
        out[key] = value
    return out
