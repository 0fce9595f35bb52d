"""On-disk conversion: a Hugging Face Qwen3-Next / Qwen3.5-MoE checkpoint folder -> a Clover one.

Streams: one decoder layer at a time is read (its tensors may span source shards; the index says
where each lives), mapped by `mapping`, and appended to an output shard of bounded size, so peak
memory is about one layer plus one output shard, not the checkpoint. Everything is written into a
temporary folder next to DST and renamed into place only once complete, so a failed run leaves
nothing at DST.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer
from tqdm import tqdm

from ..models import CloverForBlockDiffusion
from ..utils.checkpoint_io import SafetensorsSource, ShardWriter
from ..utils.files import staged_folder
from .mapping import (
    SourceShapeError, clover_config_from_hf, convert_layer, diffusion_additions, disk_name, layer_of, skipped_group,
    text_name, text_prefix,
)

SUPPORTED_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
MASK_TOKEN = "<|mask|>"
VOCAB_MULTIPLE = 64  # grown vocabularies are padded to this (kernel-friendly row counts)
TOP_LEVEL = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Files of SRC that are not carried over: weights and the config (both are rewritten).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


class ConversionError(ValueError):
    """A source checkpoint that cannot be converted (reported by the CLI as one line)."""


def _notice(msg: str) -> None:
    print(msg, file=sys.stderr)


def _mask_token(src: Path, tmp: Path, rows: int, requested: int | None, notice) -> int:
    """Choose the mask token id. With a tokenizer.json in SRC, `<|mask|>` (or the token at
    `requested`) becomes its mask token; only the mask entries of the tokenizer files are edited."""
    if not (src / "tokenizer.json").is_file():
        if (src / "tokenizer_config.json").is_file():
            notice("no tokenizer.json in SRC: tokenizer files copied unchanged, the mask token has no text")
        return rows if requested is None else requested
    tk = Tokenizer.from_file(str(src / "tokenizer.json"))
    conf_path = src / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
    token = conf.get("mask_token")
    token = token.get("content") if isinstance(token, dict) else token
    if requested is not None:
        token = tk.id_to_token(requested)
        if token is None:
            raise ConversionError(f"--mask-token-id {requested} is not in the tokenizer ({tk.get_vocab_size()} tokens)")
    token = token or MASK_TOKEN
    tk.add_special_tokens([AddedToken(token, special=True, normalized=False)])
    mask_id = tk.token_to_id(token)
    conf["mask_token"] = token
    if "added_tokens_decoder" in conf:
        conf["added_tokens_decoder"].setdefault(str(mask_id), {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        })
    tk.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n")
    if (src / "special_tokens_map.json").is_file():  # older layouts: keep the two files agreeing
        special = json.loads((src / "special_tokens_map.json").read_text())
        special["mask_token"] = token
        (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")
    return mask_id


def _grow(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Append rows set to the mean of the existing ones (a neutral start for new tokens)."""
    if rows <= weight.shape[0]:
        return weight
    extra = weight.float().mean(0, keepdim=True).to(weight.dtype).expand(rows - weight.shape[0], -1)
    return torch.cat([weight, extra])


def _layout(keys, prefix: str, num_layers: int):
    """Group SRC's tensors: per layer, top-level text tensors, and skipped towers."""
    layers, top, skipped = defaultdict(dict), {}, defaultdict(int)
    for key in keys:
        name = text_name(key, prefix)
        if name is None:
            skipped[skipped_group(key)] += 1
            continue
        i = layer_of(name)
        if i is not None and i >= num_layers:
            raise ConversionError(f"unexpected tensor {key}: the config has {num_layers} layers")
        (layers[i] if i is not None else top)[name] = key
    return layers, top, dict(skipped)


def _read(source: SafetensorsSource, names: dict) -> dict:
    return {name: source.get(key) for name, key in names.items()}


def _copy_extras(src: Path, tmp: Path) -> None:
    """Carry over tokenizer, chat template, generation config, licence... (not what was rewritten)."""
    for path in src.iterdir():
        if (path.is_file() and path.name != "config.json" and not path.name.endswith(WEIGHT_SUFFIXES)
                and not (tmp / path.name).exists()):
            shutil.copy2(path, tmp / path.name)


def _check(out: dict, expected: dict, prefix: str) -> None:
    for name, tensor in out.items():
        if name not in expected:
            raise ConversionError(f"unexpected tensor {disk_name(name, prefix)}")
        if tuple(tensor.shape) != expected[name]:
            raise ConversionError(SourceShapeError.describe(name, tuple(tensor.shape), expected[name]))


def convert_checkpoint(
    src, dst, *, dtype: str | None = None, max_shard_bytes: int = 2 * 10**9,
    mask_token_id: int | None = None, force: bool = False, progress: bool | None = None, notice=_notice,
) -> dict:
    """Convert SRC to a Clover checkpoint at DST; returns a summary (dst, num_params, mask_token_id,
    shards, skipped tensor groups)."""
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise ConversionError(f"{src}: no config.json (not a checkpoint folder)")
    if dst.exists() and not force:
        raise ConversionError(f"{dst} already exists (use --force to replace it)")
    hf = json.loads((src / "config.json").read_text())
    archs = hf.get("architectures") or [hf.get("model_type", "unknown")]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"unsupported architecture {archs[0]} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")

    with staged_folder(dst, "converting") as tmp:
        summary = _convert_into(src, tmp, hf, DTYPES.get(dtype), max_shard_bytes, mask_token_id, progress, notice)
    return {"dst": str(dst), **summary}


def _convert_into(src, tmp, hf, dtype, max_shard_bytes, mask_token_id, progress, notice) -> dict:
    source = SafetensorsSource(src, ConversionError)
    prefix = text_prefix(source.weight_map)
    layers, top, skipped = _layout(source.weight_map, prefix, clover_config_from_hf(hf).num_hidden_layers)
    for group, n in skipped.items():
        notice(f"skipping {group}.* ({n} tensors, not part of the text model)")
    extra = sorted(set(top) - set(TOP_LEVEL))
    if extra:
        raise ConversionError(f"unexpected tensor {top[extra[0]]}")
    if "model.embed_tokens.weight" not in top:
        raise ConversionError(f"missing tensor {disk_name('model.embed_tokens.weight', prefix)}")

    rows = source.shape(top["model.embed_tokens.weight"])[0]
    mask_id = _mask_token(src, tmp, rows, mask_token_id, notice)
    vocab = rows if mask_id < rows else -(-(mask_id + 1) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    cfg = clover_config_from_hf(hf, vocab_size=vocab, mask_token_id=mask_id)
    cfg.architectures = ["CloverForBlockDiffusion"]
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in CloverForBlockDiffusion(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    writer = ShardWriter(tmp, max_shard_bytes, dtype)

    def emit(out: dict) -> None:
        _check(out, expected, prefix)
        for name, tensor in out.items():
            writer.add(name, tensor)
            expected.pop(name)

    def top_level(name: str) -> torch.Tensor:
        if name not in top:
            raise ConversionError(f"missing tensor {disk_name(name, prefix)}")
        return source.get(top[name])

    embed = top_level("model.embed_tokens.weight")
    out_dtype = dtype or embed.dtype
    emit({"model.embed_tokens.weight": _grow(embed, vocab)})
    del embed
    for i in tqdm(range(cfg.num_hidden_layers), desc="converting layers",
                  disable=None if progress is None else not progress):
        t = _read(source, layers.get(i, {}))
        try:
            out = convert_layer(t, cfg, i)
        except KeyError as e:
            raise ConversionError(f"missing tensor {disk_name(e.args[0], prefix)}") from None
        except SourceShapeError as e:
            raise ConversionError(SourceShapeError.describe(disk_name(e.name, prefix), e.shape, e.want)) from None
        if t:
            raise ConversionError(f"unexpected tensor {disk_name(sorted(t)[0], prefix)}")
        emit({**out, **diffusion_additions(cfg, i)})
    emit({"model.norm.weight": top_level("model.norm.weight")})
    if "lm_head.weight" in expected:
        emit({"lm_head.weight": _grow(top_level("lm_head.weight"), vocab)})
    if expected:
        raise ConversionError(f"missing tensor {disk_name(sorted(expected)[0], prefix)}")
    shards = writer.close()

    cfg.dtype = out_dtype
    cfg.save_pretrained(tmp)
    _copy_extras(src, tmp)
    return {
        "architecture": hf["architectures"][0], "num_params": writer.num_params, "vocab_size": vocab,
        "mask_token_id": mask_id, "shards": shards, "skipped": skipped,
    }
