"""The registry of public block-diffusion families and their loader.

`family_of(config)` picks a family from config.json (`architectures` first, then `model_type`) and
refuses anything else in one line; `load_family(folder)` builds the model from the folder as
published (config.json, safetensors, tokenizer and chat template; no remote code runs) and
resolves the decoding settings the family publishes: the mask token id (config.json's
`mask_token_id`, else the tokenizer's id of the family's mask token, else the published id), the
block size (config.json's `block_size` / `bd_size`, else generation_config.json's, else the
family's default) and the threshold (generation_config.json's, else the family's default).
Everything but `load_family` is torch-free.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    config: str  # "module:Class", torch-free
    model: str  # "module:Class"
    title: str

    def config_class(self):
        return _load(self.config)

    def model_class(self):
        return _load(self.model)


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(f"clover.models.{module}"), name)


FAMILIES: tuple[Family, ...] = (
    Family("sdar", ("SDARForCausalLM",), ("sdar",), "configuration_sdar:SDARConfig",
           "modeling_sdar:SDARForCausalLM", "SDAR (dense, Qwen3 layout)"),
    Family("sdar_moe", ("SDARMoeForCausalLM",), ("sdar_moe",), "configuration_sdar:SDARMoeConfig",
           "modeling_sdar:SDARMoeForCausalLM", "SDAR-MoE (Qwen3-MoE layout)"),
    Family("llada2", ("LLaDA2MoeModelLM",), ("llada2_moe",), "configuration_llada2:LLaDA2MoeConfig",
           "modeling_llada2:LLaDA2MoeModelLM", "LLaDA2.0 / LLaDA2.1 (Ling 2.0 MoE layout)"),
    Family("fast_dllm_v2", ("Fast_dLLM_QwenForCausalLM",), ("Fast_dLLM_Qwen",),
           "configuration_fast_dllm:FastDLLMConfig", "modeling_fast_dllm:FastDLLMForCausalLM",
           "Fast-dLLM v2 (Qwen2.5 layout)"),
)


class UnknownFamily(ValueError):
    """config.json names no family Clover knows (one line)."""


def family_of(config: dict, where: str = "config.json") -> Family:
    archs = config.get("architectures") or []
    for fam in FAMILIES:
        if any(a in fam.architectures for a in archs):
            return fam
    for fam in FAMILIES:
        if config.get("model_type") in fam.model_types:
            return fam
    known = ", ".join(a for f in FAMILIES for a in f.architectures)
    raise UnknownFamily(f"{where}: architectures {archs or None} / model_type {config.get('model_type')!r} "
                        f"is not a block-diffusion family Clover runs (known: {known})")


def is_family_folder(folder) -> bool:
    """True when folder/config.json names one of the families (not a Clover model)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
        family_of(config)
        return True
    except (OSError, ValueError, AttributeError):
        return False


def read_family_config(folder):
    """(family, its config object) of a folder, torch-free."""
    from ..utils.checkpoint import read_config

    raw = read_config(folder, clover=False)
    fam = family_of(raw, f"{Path(folder) / 'config.json'}")
    return fam, fam.config_class().from_dict(raw)


def generation_settings(folder) -> dict:
    path = Path(folder) / "generation_config.json"
    try:
        value = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        value = {}
    return value if isinstance(value, dict) else {}


@dataclass
class LoadedFamily:
    family: Family
    model: object
    tokenizer: object
    mask_token_id: int
    block_size: int
    threshold: float
    eos_token_ids: tuple[int, ...]


def family_settings(folder, model_class, config) -> dict:
    """The decoding settings a folder publishes (torch-free): mask token id, block size, threshold,
    end-of-sequence ids; each falls back to the family's published default."""
    gen = generation_settings(folder) if folder is not None else {}
    mask = config.raw.get("mask_token_id")
    if mask is None and folder is not None:
        mask = _token_id(Path(folder) / "tokenizer.json", model_class.mask_token)
    block = config.raw.get("block_size") or config.raw.get("bd_size") or gen.get("block_size") \
        or gen.get("block_length") or model_class.default_block_size
    eos = gen.get("eos_token_id", config.raw.get("eos_token_id"))
    eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return {"mask_token_id": model_class.mask_token_id if mask is None else int(mask), "block_size": int(block),
            "threshold": float(gen.get("threshold", model_class.default_threshold)), "eos_token_ids": eos}


def decode_defaults(folder) -> dict:
    """{"block_size", "threshold"} a family folder publishes (else the family's defaults); {} for any
    other folder (a Clover model keeps DecodeConfig's). Imports the family's model class (torch)."""
    if folder is None or not is_family_folder(folder):
        return {}
    fam, config = read_family_config(folder)
    settings = family_settings(folder, fam.model_class(), config)
    return {"block_size": settings["block_size"], "threshold": settings["threshold"]}


def _token_id(path: Path, token: str) -> int | None:
    """The id of `token` in a tokenizer.json (added tokens, then the vocabulary); None if absent."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for added in data.get("added_tokens") or []:
        if added.get("content") == token:
            return int(added["id"])
    vocab = (data.get("model") or {}).get("vocab")
    return int(vocab[token]) if isinstance(vocab, dict) and token in vocab else None


def load_family(folder, dtype=None, device=None, with_tokenizer: bool = True) -> LoadedFamily:
    fam, config = read_family_config(folder)
    cls = fam.model_class()
    model = cls.from_state_dict(config, _read_weights(folder), dtype, device)
    tokenizer = load_tokenizer(folder) if with_tokenizer else None
    return LoadedFamily(fam, model, tokenizer, **family_settings(folder, cls, config))


def _read_weights(folder):
    from .modeling_family import read_weights

    return read_weights(folder)


def load_tokenizer(folder):
    """The folder's tokenizer through transformers' own classes (trust_remote_code off); its chat
    template comes with it (tokenizer_config.json or chat_template.jinja)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notice that config.json's model_type is no class it knows
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except (ValueError, OSError, KeyError):
        if (Path(folder) / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(folder))
        raise
    finally:
        hf_logging.set_verbosity(level)
