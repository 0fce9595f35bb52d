"""Streaming safetensors I/O shared by `clover convert` and `clover quantize`: read a checkpoint
one tensor at a time (single file or sharded with an index) and write one in bounded shards, named
and indexed as transformers does, so neither tool ever holds a whole model in memory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint import CheckpointError, read_header, weight_files
from .files import keep_umask_mode


class SafetensorsSource:
    """The safetensors of a checkpoint folder, read lazily; `error` is the exception type raised
    for a checkpoint that is not readable as such (each tool reports its own as one line)."""

    def __init__(self, src: Path, error: type[Exception] = ValueError):
        self.src, self.error, self._open = src, error, {}
        try:  # every file checked whole before the first tensor is read (a bad one: one line naming it)
            self.weight_map = {}
            for file in weight_files(src):
                self.weight_map.update(dict.fromkeys(read_header(file), file.name))
        except CheckpointError as e:
            raise error(str(e)) from None

    def _file(self, key: str):
        file = self.weight_map.get(key)
        if file is None:
            raise self.error(f"{self.src}: missing tensor {key}")
        return self._handle(file, f" (holding {key})")

    def _handle(self, file: str, holding: str = ""):
        if file not in self._open:
            path = self.src / file
            if not path.is_file():
                raise self.error(f"shard {file}{holding} is missing from {self.src}")
            self._open[file] = safe_open(path, "pt")
        return self._open[file]

    def get(self, key: str) -> torch.Tensor:
        return self._file(key).get_tensor(key)

    def shape(self, key: str) -> tuple:
        return tuple(self._file(key).get_slice(key).get_shape())

    def stored_order(self) -> list[str]:
        """Every tensor name as `safetensors.torch.load_file` gives them, file after file: each file's
        names in storage order (`offset_keys`), or sorted where safetensors has no `offset_keys` (its
        `load_file` then read them sorted)."""
        handles = [self._handle(file) for file in dict.fromkeys(self.weight_map.values())]
        return [k for h in handles for k in getattr(h, "offset_keys", h.keys)()]


class ShardWriter:
    """Appends tensors to safetensors shards of at most `max_bytes` (one tensor may exceed it
    alone), optionally cast to `dtype`; `close` names the shards and writes the index."""

    def __init__(self, folder: Path, max_bytes: int, dtype: torch.dtype | None = None):
        self.folder, self.max_bytes, self.dtype = folder, max_bytes, dtype
        self.buffer, self.size, self.files, self.total, self.num_params = {}, 0, [], 0, 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.to(self.dtype) if self.dtype else tensor
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.size + nbytes > self.max_bytes:
            self._flush()
        self.buffer[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes
        self.num_params += tensor.numel()

    def _flush(self) -> None:
        file = f"part-{len(self.files):05d}.safetensors"
        save_file(self.buffer, self.folder / file, metadata={"format": "pt"})
        keep_umask_mode(self.folder / file)  # safetensors writes 0600
        self.files.append((file, list(self.buffer)))
        self.buffer, self.size = {}, 0

    def close(self) -> list[str]:
        if self.buffer or not self.files:
            self._flush()
        if len(self.files) == 1:
            os.replace(self.folder / self.files[0][0], self.folder / "model.safetensors")
            return ["model.safetensors"]
        n, weight_map, names = len(self.files), {}, []
        for k, (file, keys) in enumerate(self.files):
            name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / file, self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
            names.append(name)
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names
