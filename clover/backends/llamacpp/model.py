"""`LlamaCppModel`: the patched llama.cpp behind the decoding engine's model interface.

The engine (clover/engine/engine.py) calls `model(ids, cache=..., block_size, draft_len,
clean_block_size, pad_mask, logits_to_keep, logits_index).logits`, `model.new_cache(rows, capacity)`
and, on the cache, `start_recording`, `rollback(keep)`, `select_rows`, `append_rows`. This adapter
maps one such stream-layout call onto llama.cpp sequences (one per batch row):

* the clean segment is committed to the row's sequence: causally (one decode) when its windows are
  of one token (ar, self_spec), else window by window, each window one block-mode decode of the
  rows' real tokens (windows anchored at the segment's end, as `window_ids`);
* the draft window is decoded on a scratch sequence copied from the committed one
  (`llama_memory_seq_cp`), in block mode, all logits; the scratch is dropped, so a draft reads the
  committed GDN state and K/V without changing them;
* `start_recording` copies each row's sequence to a backup; `rollback(keep)` restores the backup
  and re-commits the first `keep` tokens (one causal decode; llama.cpp cannot rewind a recurrent
  state, the PyTorch cache re-advances it from recorded inputs without a forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import LlamaCppContext


@dataclass
class _Out:
    logits: torch.Tensor


class LlamaCppCache:
    """Rows of one model: the llama.cpp sequence id of each row and its committed length."""

    def __init__(self, model: "LlamaCppModel", rows: int):
        self.model = model
        self.seqs = [model.take_seq() for _ in range(rows)]
        self.recording: dict | None = None

    def release(self) -> None:
        """Hand every sequence (and backup) back to the model; the engine drops a finished cache."""
        for s in self.seqs + list((self.recording or {}).get("backup", {}).values()):
            self.model.give_seq(s)
        self.seqs, self.recording = [], None

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown
            pass

    @property
    def lens(self) -> torch.Tensor:
        return torch.tensor([self.model.cpp.lens[s] for s in self.seqs])

    def start_recording(self) -> None:
        backups = {}
        for s in self.seqs:
            b = backups[s] = self.model.take_seq()
            self.model.cpp.fork(s, b)
        self.recording = {"backup": backups, "tokens": {s: [] for s in self.seqs}}

    def record(self, seq: int, tokens: list[int]) -> None:
        if self.recording is not None:
            self.recording["tokens"][seq] += tokens

    def rollback(self, keep: torch.Tensor) -> None:
        rec, self.recording = self.recording, None
        cpp = self.model.cpp
        redo_tokens, redo_seqs = [], []
        for s, k in zip(self.seqs, keep.tolist()):
            done = rec["tokens"][s]
            backup = rec["backup"][s]
            if k < len(done):
                cpp.fork(backup, s)
                redo_tokens.append(done[:k])
                redo_seqs.append(s)
            self.model.give_seq(backup)
        if redo_seqs:
            self.model.decode(redo_tokens, redo_seqs, 0, [0] * len(redo_seqs))

    def select_rows(self, idx: torch.Tensor) -> None:
        keep = set(idx.tolist())
        for r, s in enumerate(self.seqs):
            if r not in keep:
                self.model.give_seq(s)
        self.seqs = [self.seqs[r] for r in idx.tolist()]

    def append_rows(self, other: "LlamaCppCache") -> None:
        self.seqs += other.seqs
        other.seqs = []


class LlamaCppModel:
    """Presents `CloverForBlockDiffusion`'s forward / new_cache to the engine, computed by llama.cpp."""

    shift, block_align = True, "relative"  # the model seam (engine/model_api.py), as Clover's

    def __init__(self, gguf_path: str | Path, config, max_rows: int = 8, threads: int = 1, n_ctx: int | None = None,
                 parity: bool = False, variant: str = "clover", build: str | Path | None = None):
        self.config = config
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.generation_config = None
        n_ctx = n_ctx or config.max_position_embeddings
        extra = dict(kv_type="f32", flash_attn=False) if parity else {}
        # each row may hold a committed sequence, a backup (self_spec) and a scratch (draft) at once
        self.cpp = LlamaCppContext(gguf_path, rows=3 * max_rows, n_ctx=n_ctx, threads=threads, kv_unified=True,
                                 variant=variant, build=build, **extra)
        self.free = list(range(3 * max_rows))

    def close(self) -> None:
        self.cpp.close()

    def eval(self):
        return self

    def take_seq(self) -> int:
        if not self.free:
            raise RuntimeError("llama.cpp model: more rows than max_rows")
        seq = self.free.pop(0)
        self.cpp.drop(seq)
        return seq

    def give_seq(self, seq: int) -> None:
        if self.cpp.ctx is None:  # closed: a cache outliving its model has nothing left to free
            return
        self.cpp.drop(seq)
        self.free.insert(0, seq)  # LIFO: a draft's scratch keeps its id, so llama.cpp can reuse the graph

    def new_cache(self, batch_size: int, capacity: int = 256) -> LlamaCppCache:
        return LlamaCppCache(self, batch_size)

    def decode(self, tokens: list[list[int]], seqs: list[int], block: int, keep: list) -> list[np.ndarray]:
        """One llama_decode per group of rows with the same token count (in block mode a sequence's
        tokens must be one ubatch); returns per row the logits of the columns keep[i] names (an int k:
        its last k; a list: those column indices)."""
        self.cpp.set_block(block)
        out: list[np.ndarray | None] = [None] * len(tokens)
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(tokens):
            if t:
                groups.setdefault(len(t) if block else 0, []).append(i)
            else:
                out[i] = np.zeros((0, self.cpp.n_vocab), np.float32)
        for members in groups.values():
            res = self.cpp.decode([tokens[i] for i in members], [keep[i] for i in members], [seqs[i] for i in members])
            for i, r in zip(members, res):
                out[i] = r
        return out

    def commit_chunks(self, n_clean: int, clean_block_size: int, rows: int, pad: list[list[bool]]) -> list[list[int]]:
        """The clean segment's columns, one list per decode. Causal (clean_block_size 1): all in one. Block mode:
        the windows of clean_block_size anchored at the segment's end, as many per decode as fit in n_batch (the
        patch keeps attention, the bidirectional branch and the right conv inside each window of a
        sequence's tokens, windows anchored at their end) when each row's padding is a prefix of the
        segment (so its real tokens keep those windows); else one window per decode."""
        if clean_block_size <= 1:
            return [list(range(n_clean))]
        from ...models.modeling_clover import window_ids

        wid = window_ids(n_clean, clean_block_size).tolist()
        windows = [[c for c in range(n_clean) if wid[c] == w] for w in sorted(set(wid))]
        if not all(p[:n_clean] == sorted(p[:n_clean], reverse=True) for p in pad):  # padding not only on the left
            return windows
        chunks: list[list[int]] = []
        for cols in windows:
            if chunks and rows * (len(chunks[-1]) + len(cols)) <= self.cpp.n_batch:
                chunks[-1] += cols
            else:
                chunks.append(list(cols))
        return chunks

    def __call__(self, input_ids, cache: LlamaCppCache | None = None, block_size: int | None = None, draft_len: int = 0,
                 clean_block_size: int | None = None, pad_mask=None, logits_to_keep: int = 0, logits_index=None, **unused):
        if cache is None:
            raise ValueError("the llama.cpp model needs a cache (model.new_cache)")
        ids = input_ids.tolist()
        rows, length = len(ids), len(ids[0])
        block = block_size or 1
        clean_block_size = clean_block_size or (block if draft_len else 1)
        n_clean = length - draft_len
        pad = pad_mask.tolist() if pad_mask is not None else [[False] * length for _ in range(rows)]
        keep = logits_to_keep or length
        first = length - keep  # columns >= first are kept; of those only logits_index's when given
        index = None if logits_index is None else torch.as_tensor(logits_index).reshape(-1).tolist()
        out_cols = list(range(first, length)) if index is None else [first + i for i in index]
        slot: dict[int, list[int]] = {}  # absolute column -> its output positions
        for i, c in enumerate(out_cols):
            slot.setdefault(c, []).append(i)
        logits = torch.zeros(rows, len(out_cols), self.cpp.n_vocab)
        seqs = cache.seqs

        def fill(r, cols, res):  # cols: the absolute columns whose logits `res` holds, in order
            for c, row in zip(cols, res):
                logits[r, slot[c]] = torch.from_numpy(row)  # (a column named twice in logits_index: both)

        # 1. commit the clean segment
        if n_clean:
            for cols in self.commit_chunks(n_clean, clean_block_size, rows, pad):
                toks, want, where = [], [], []
                for r in range(rows):
                    real = [c for c in cols if not pad[r][c]]
                    toks.append([ids[r][c] for c in real])
                    where.append([c for c in real if c in slot])
                    want.append([j for j, c in enumerate(real) if c in slot])
                res = self.decode(toks, seqs, clean_block_size if clean_block_size > 1 else 0, want)
                for r in range(rows):
                    cache.record(seqs[r], toks[r])
                    fill(r, where[r], res[r])
        # 2. the draft window, on scratch copies of the committed sequences; the head runs only for
        # the columns asked for (a draft's still-masked ones when logits_index is given)
        if draft_len:
            scratch = [self.take_seq() for _ in range(rows)]
            for s, t in zip(seqs, scratch):
                self.cpp.fork(s, t)
            toks = [row[n_clean:] for row in ids]
            cols = [c for c in range(n_clean, length) if c in slot]
            res = self.decode(toks, scratch, block, [[c - n_clean for c in cols]] * rows)
            for r in range(rows):
                fill(r, cols, res[r])
            for t in scratch:
                self.give_seq(t)
        return _Out(logits)


def load_llamacpp(model_dir: str | Path | None = None, gguf: str | Path | None = None, threads: int = 1, max_rows: int = 8,
                parity: bool = False):
    """(model, tokenizer) for a Clover model folder; its GGUF is exported (f32) next to a temp dir
    unless `gguf` names one."""
    import tempfile

    from transformers import AutoTokenizer

    from ...api import DEFAULT_MODEL
    from ...models import CloverConfig
    from ..gguf_export import export_gguf

    folder = Path(model_dir) if model_dir else DEFAULT_MODEL
    config = CloverConfig.from_pretrained(folder)
    if gguf is None:
        tmp = Path(tempfile.mkdtemp(prefix="clover-gguf-"))
        gguf = tmp / "model-f32.gguf"
        export_gguf(folder, gguf, "f32")
    model = LlamaCppModel(gguf, config, max_rows=max_rows, threads=threads, parity=parity)
    return model, AutoTokenizer.from_pretrained(folder)
