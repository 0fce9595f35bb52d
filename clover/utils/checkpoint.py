"""Checks of a checkpoint folder before anything loads it, each failure one `CheckpointError`
(a ValueError) that names the file: config.json is a JSON object (and a Clover config where one is
needed), every safetensors file is whole (its header parses and the file holds every byte the
header describes), the tokenizer files parse, and the weights' shapes fit the config. The file checks read only the 8-byte
length and the JSON header of each safetensors file (no torch), so they cost milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header
CONVERT_HINT = "convert a Hugging Face Qwen3-Next / Qwen3.5-MoE checkpoint with `clover convert SRC DST`"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as it is (one line, naming the file)."""


def read_json(path: Path, what: str = "JSON") -> dict:
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not {what} ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not {what} (a JSON object is needed, found {type(value).__name__})")
    return value


def read_config(folder: str | Path, clover: bool = True) -> dict:
    """config.json as a dict; with `clover`, refuse any model_type but clover or a public block-diffusion
    family (clover/models/families.py), pointing to convert."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (not a model folder)")
    config = read_json(path, "a JSON config")
    if clover and config.get("model_type") != "clover":
        families = families_module()
        try:
            families.family_of(config)
            return config
        except families.UnknownFamily:
            pass
        raise CheckpointError(f"{path}: model_type {config.get('model_type')!r} is not a Clover model; {CONVERT_HINT}")
    return config


def families_module():
    """clover/models/families.py (the public block-diffusion families), without the package
    clover.models, whose import loads torch: the module itself is torch-free."""
    import importlib.util
    import sys

    name = "clover.models.families"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "models" / "families.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a folder: the shards its index names, or model.safetensors."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: missing (named by {index.name})")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file, after checking that the file is whole."""
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: empty file (not a safetensors file)")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{path}: not a safetensors file, or truncated (its header length {n} "
                                  f"does not fit in {size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        end = 0
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, stop = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            if not (isinstance(info["dtype"], str) and 0 <= start <= stop):
                raise ValueError(name)
            tensors[name] = (info["dtype"], shape)
            end = max(end, stop)
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a safetensors header)") from None
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated ({size:,} bytes; its header describes {8 + n + end:,})")
    return tensors


def read_weights(folder: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor's (dtype, shape) across the folder's safetensors files, each file checked whole."""
    tensors = {}
    for file in weight_files(folder):
        tensors.update(read_header(file))
    return tensors


def check_tokenizer(folder: str | Path) -> None:
    """The folder's tokenizer.json (if any) is one the tokenizers library reads, and its
    tokenizer_config.json a JSON object; else a one-line CheckpointError naming the file."""
    folder = Path(folder)
    if (folder / "tokenizer_config.json").is_file():
        read_json(folder / "tokenizer_config.json", "a tokenizer config")
    path = folder / "tokenizer.json"
    if not path.is_file():
        return
    spec = read_json(path, "a tokenizer.json")
    if not isinstance(spec.get("model"), dict) or not isinstance(spec.get("added_tokens"), list):
        raise CheckpointError(f"{path}: not a tokenizer.json (no model object or added_tokens list)")
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # the library's own reason (a Rust error: no finer type)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: not a tokenizer the tokenizers library reads ({reason})") from None


def check_folder(folder: str | Path, clover: bool = True) -> tuple[dict, dict]:
    """(config dict, {tensor: (dtype, shape)}) of a checkpoint folder, or a one-line CheckpointError."""
    config = read_config(folder, clover)
    weights = read_weights(folder)
    check_tokenizer(folder)
    return config, weights


def check_shapes(folder: str | Path, model, weights: dict) -> None:
    """Every tensor in the files has the shape the model built from config.json expects (the model
    may live on the meta device); a mismatch names the tensor, both shapes and the config fields."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    config = model.config
    for name, (_, shape) in weights.items():
        want = expected.get(name)
        if want is not None and want != shape:
            fields = [f"{k} {getattr(config, k)}" for k in ("vocab_size", "hidden_size") if hasattr(config, k)]
            raise CheckpointError(f"{Path(folder) / 'config.json'} does not match the weights: {name} is "
                                  f"{list(shape)} in the files but {list(want)} for this config ({', '.join(fields)})")


@contextlib.contextmanager
def load_progress(folder: str | Path, stream=None, min_bytes: int = 2**30):
    """transformers' 'Loading weights' bar only where it helps: on a terminal, for a sharded
    checkpoint or one of at least `min_bytes`; silent otherwise (restores the previous setting)."""
    import sys

    from transformers.utils import logging as hf_logging

    files = weight_files(folder)
    stream = stream or sys.stderr
    show = bool(getattr(stream, "isatty", lambda: False)()) and (
        len(files) > 1 or sum(f.stat().st_size for f in files) >= min_bytes)
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if show else hf_logging.disable_progress_bar)()
    try:
        yield show
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
