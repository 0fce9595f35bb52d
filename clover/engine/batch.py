"""The row batch every decoding mode shares: the running rows (their `Sequence`s, in cache row
order), their cache rows, the pending clean segment (committed with the next forward), the draft
window, prefill with left padding, rows joining and leaving between steps. Modes advance it one
step at a time (engine/modes.py); the runner (engine/runner.py) is the only code that calls the
model, and only `RowBatch.forward` and `prefill` call the runner here."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .layout import Layout
from .sequence import Sequence

Pending = tuple[torch.Tensor, torch.Tensor | None]  # clean ids [rows, L], left padding [rows, L] or None
Started = tuple[object, int]  # a cache of new rows holding the first n tokens each prefills (read, not changed), and n


class Forward(NamedTuple):
    """The forward a job plans next: [pending ; window], `draft_len` of it draft (0: all committed as
    fed), logits of the last `keep` columns (`index`: of those columns only). A window of width 0
    commits the pending segment only. `sub_block_head`: a sub-block step's draft (greedy: only the
    first sub-block with masks is read), or a greedy step's without shift (only the masked targets
    are read), whose other columns a model may leave uncomputed."""

    window: torch.Tensor
    draft_len: int
    keep: int
    block_size: int | None = None
    index: torch.Tensor | None = None
    sub_block_head: bool = False


class RowBatch:
    layout = Layout()  # where windows sit (engine/layout.py); the engine sets the model's
    # a step splits (`split_commit`) when the rows that commit nothing would carry at least this many
    # clean columns in all (a forward's own cost outweighs fewer); None: never
    split_min_saved: int | None = 96

    @classmethod
    def for_runner(cls, runner, width: int, clean_block_size: int, mask_id: int, device, prefill_chunk: int) -> "RowBatch":
        """A row batch whose prompts' last chunk rides with the first window: a runner that caps the
        tokens of a forward (compiled graphs) gets chunks that fit with the window (a 60-token tail and
        4 columns is 64, not 68)."""
        cap = runner.prefill_chunk
        if cap:
            prefill_chunk = min(prefill_chunk, max(cap - width, clean_block_size))
        return cls(runner, width, clean_block_size, mask_id, device, prefill_chunk)

    def __init__(self, runner, width: int, clean_block_size: int, mask_id: int, device, prefill_chunk: int):
        self.runner, self.width, self.clean_block_size = runner, width, clean_block_size  # window columns, clean windows
        self.mask_id, self.device, self.prefill_chunk = mask_id, device, prefill_chunk
        self.seqs: list[Sequence] = []
        self.cache = None
        self.pending: Pending | None = None
        self.window: torch.Tensor | None = None  # [rows, width]

    # ---- join / leave -----------------------------------------------------------------------------
    def join(self, seqs: list[Sequence], capacity: int, start: "Started | None" = None) -> None:
        """Prefill new rows in caches of their own (every chunk now; after what `start` holds) and append
        them to the running rows."""
        prefill = Prefill(self, seqs, capacity, start=start)
        while prefill.chunks_left:
            prefill.advance()
        self.admit(prefill)

    def admit(self, prefill: "Prefill") -> None:
        """Append rows whose prefill has no chunk left: their cache rows, their last chunk (pending, to
        ride with the next forward) and their first window, the layout's ([last prompt token, MASK...]
        for Clover)."""
        seqs, cache, pending = prefill.seqs, prefill.cache, prefill.pending()
        first = [self.layout.first_window(s.prompt_ids, self.clean_block_size, self.width, self.mask_id) for s in seqs]
        window = torch.tensor(first, dtype=torch.long, device=self.device)
        if self.seqs:
            self.cache.append_rows(cache)
            self.pending = _stack_pending([(self.pending, len(self.seqs)), (pending, len(seqs))], self.device)
            window = torch.cat([self.window, window])
        else:
            self.cache, self.pending = cache, pending
        self.window = window
        self.seqs += seqs

    def chunk(self) -> int:
        """Prompt tokens per prefill forward: `prefill_chunk` in whole clean windows."""
        return max(self.clean_block_size, self.prefill_chunk // self.clean_block_size * self.clean_block_size)

    def prefill_forwards(self, prompt_ids: list[int]) -> int:
        """Prefill forwards a prompt takes before it can join (its last chunk rides with a decoding one)."""
        return max(-(-len(self.layout.prefilled(prompt_ids, self.clean_block_size)) // self.chunk()) - 1, 0)

    def commit_next(self, pending: Pending, clean_block_size: int) -> None:
        """The next forward commits `pending` (clean ids, left padding) first, as clean windows of
        `clean_block_size` (a job's finished window: one clean block of its own width)."""
        self.pending, self.clean_block_size = pending, clean_block_size

    def drop_finished(self) -> torch.Tensor | None:
        """Free the rows of finished sequences; returns the kept row indices when some left (for the
        mode's own per-row state), None when nothing changed or nobody is left."""
        keep = [r for r, s in enumerate(self.seqs) if not s.finished]
        if len(keep) == len(self.seqs):
            return None
        self.seqs = [self.seqs[r] for r in keep]
        if not keep:
            self.pending = self.cache = None  # nothing runs: free the cache
            return None
        idx = torch.tensor(keep, device=self.device)
        self.cache.select_rows(idx)
        self.window = self.window[idx]
        if self.pending is not None:
            clean, pad = self.pending
            pad = pad[idx] if pad is not None else None
            if pad is None or not bool(pad.all()):  # someone still commits
                self.pending = (clean[idx], pad if pad is not None and bool(pad.any()) else None)
            else:
                self.pending = None
        return idx

    # ---- model calls ------------------------------------------------------------------------------
    def run(self, need: Forward) -> torch.Tensor:
        """The logits of a planned forward."""
        return self.forward(need.window, need.draft_len, need.keep, need.block_size, need.index, need.sub_block_head)

    def forward(self, window: torch.Tensor, draft_len: int, keep: int, block_size: int | None = None,
                index: torch.Tensor | None = None, sub_block_head: bool = False,
                draft_lens: list[int] | None = None) -> torch.Tensor:
        """One model step on [pending clean segment ; window]; the pending segment is consumed and
        every running row counts one forward. When only some rows commit (`split_commit`), those rows'
        clean columns run first in a forward of their own rows (not counted: a commit, as prefill)
        and every row's window after it, so no row pays for columns it does not need. `draft_lens`:
        each row's own draft width and block size (a model with `ragged_drafts`; the window
        right-padded to `draft_len`)."""
        ids, pad, pending = window, None, self.pending
        self.pending = None
        asked = {"sub_block_head": True} if sub_block_head else {}  # a model that knows no such step is not asked
        ragged = {"draft_lens": draft_lens} if draft_lens is not None else {}
        for s in self.seqs:
            s.forward_passes += 1
        split = pending is not None and self.splits(window, draft_len, keep, index)
        if split and (rows := self.split_commit(pending)) is not None:
            return self._split_forward(pending, rows, window, draft_len, keep, block_size, index, asked | ragged)
        if pending is not None:
            clean, clean_pad = pending
            ids, asked = torch.cat([clean, window], dim=1), {}  # not a draft alone: one graph with the others
            if clean_pad is not None:
                pad = torch.cat([clean_pad, clean_pad.new_zeros(window.shape)], dim=1)
        return self.runner.forward(ids, self.cache, block_size=block_size, draft_len=draft_len,
                                   clean_block_size=self.clean_block_size, pad_mask=pad, logits_to_keep=keep,
                                   logits_index=index, **asked, **ragged)

    def splits(self, window: torch.Tensor, draft_len: int, keep: int, index: torch.Tensor | None) -> bool:
        """Whether a step's window may run after its pending segment, in a forward of its own: a window
        all draft (kept logits on it), or one clean window committed as fed (AR's last token; the clean
        windows of [pending ; window], counted from the end, are those of pending then the window)."""
        if 0 < draft_len == window.shape[1]:
            return index is None or keep <= draft_len
        return draft_len == 0 and window.shape[1] == self.clean_block_size

    def split_commit(self, pending: Pending) -> torch.Tensor | None:
        """The rows that commit a clean segment of `pending` when a split step pays (their own commit
        forward, then the window of every row: `splits`): some rows commit nothing and would carry
        at least `split_min_saved` clean columns in all (None: one fused forward)."""
        clean, pad = pending
        if pad is None or self.cache.recording or self.split_min_saved is None:
            return None
        commits = ~pad.all(1)
        n = int(commits.sum())
        if n == 0 or (len(self.seqs) - n) * clean.shape[1] < max(self.split_min_saved, 1):
            return None
        return commits.nonzero().squeeze(1)

    def _split_forward(self, pending: Pending, rows: torch.Tensor, window: torch.Tensor, draft_len: int, keep: int,
                       block_size: int | None, index: torch.Tensor | None, asked: dict) -> torch.Tensor:
        """`forward` as two: rows `rows` commit their clean columns in a cache of their own rows (written
        back after), then every row runs its window. Logits of a kept clean column (the last: `keep`
        past the window) come from the commit forward, for the committing rows (zeros elsewhere)."""
        clean, pad = pending
        clean, pad = clean[rows], pad[rows]
        lead = int(pad.all(0).long().cumprod(0).sum())  # columns padded in every committing row
        clean, pad = clean[:, lead:], pad[:, lead:]
        self.cache.reserve(clean.shape[1] + window.shape[1])  # the rows written back fit as they are
        sub = self.cache.copy_rows(rows)
        extra = keep - window.shape[1]
        first = self.runner.forward(clean, sub, clean_block_size=self.clean_block_size,
                                    pad_mask=pad if bool(pad.any()) else None, logits_to_keep=max(extra, 1))
        self.cache.put_rows(rows, sub)
        logits = self.runner.forward(window, self.cache, block_size=block_size, draft_len=draft_len,
                                     clean_block_size=self.clean_block_size, logits_to_keep=keep - max(extra, 0),
                                     logits_index=index, **asked)
        if extra <= 0:
            return logits
        head = logits.new_zeros(logits.shape[0], extra, logits.shape[2]).index_copy_(0, rows, first[:, -extra:])
        return torch.cat([head, logits], dim=1)


class Prefill:
    """New rows on their way into a row batch: the prompts up to their first window (prompt[:-1] for
    Clover; the layout's), left-padded, committed to a cache of their own one chunk per `advance`,
    chunk boundaries on clean windows counted from the end. The last chunk is not run here: it rides
    with the rows' first decoding forward (`pending`, after `RowBatch.admit`). An engine advances a
    long prompt's chunks between the decoding steps of its running rows; with `tail` (whole clean
    windows) the last chunk is cut there too and only its last `tail` tokens ride with that forward,
    which the running rows share (their columns are padded to its width). With `start` (a cache of
    these rows holding the first n tokens of each one's prefill, and n) only the rest is prefilled,
    after a copy of it, its clean windows anchored at its own end."""

    def __init__(self, batch: RowBatch, seqs: list[Sequence], capacity: int, tail: int | None = None,
                 start: Started | None = None):
        self.seqs, self.runner, self.bs = list(seqs), batch.runner, batch.clean_block_size
        self.cache, done = batch.runner.new_cache(len(seqs), capacity=capacity), 0
        if start is not None:  # copied into a cache of the runner's own making (its capacity buckets)
            self.cache.put_rows(torch.arange(len(seqs), device=batch.device), start[0])
            done = start[1]
        cleans = [batch.layout.prefilled(s.prompt_ids, self.bs)[done:] for s in seqs]
        width = max(map(len, cleans))
        self.ids, pad = left_padded(cleans, batch.device)
        self.pad = pad if pad is not None else torch.zeros_like(self.ids, dtype=torch.bool)
        chunk = batch.chunk()
        self.cuts = [0] + list(range(width % chunk or chunk, width, chunk)) + [width]  # the next chunk: cuts[0:2]
        if tail and width - tail > self.cuts[-2]:
            self.cuts.insert(-1, width - tail)

    @property
    def chunks_left(self) -> int:
        """Prefill forwards still to run before the rows can join (the last chunk is not one)."""
        return max(len(self.cuts) - 2, 0)

    def advance(self) -> None:
        """Commit the next chunk."""
        a, b = self.cuts.pop(0), self.cuts[0]
        pad = self.pad[:, a:b]
        self.runner.forward(self.ids[:, a:b], self.cache, clean_block_size=self.bs,
                            pad_mask=pad if pad.any() else None, logits_to_keep=1)

    def pending(self) -> Pending | None:
        """The last chunk (clean ids, left padding), or None when the prompts leave nothing to prefill."""
        a = self.cuts[-2]
        pad = self.pad[:, a:]
        if pad.all():  # also when there are no columns
            return None
        return self.ids[:, a:], pad if pad.any() else None


def _stack_pending(groups: list[tuple[Pending | None, int]], device) -> Pending | None:
    """Pending clean segments of row groups ((segment, rows) each) as one, left-padded to a common width."""
    parts = []
    for p, rows in groups:
        ids, pad = p if p is not None else (torch.zeros(rows, 0, dtype=torch.long, device=device), None)
        parts.append((ids, pad if pad is not None else torch.zeros_like(ids, dtype=torch.bool)))
    width = max(ids.shape[1] for ids, _ in parts)
    ids = torch.cat([F.pad(i, (width - i.shape[1], 0)) for i, _ in parts])
    pad = torch.cat([F.pad(m, (width - m.shape[1], 0), value=True) for _, m in parts])
    if width == 0 or bool(pad.all()):
        return None
    return ids, pad if bool(pad.any()) else None


def merge(batches: list[RowBatch], clean_block_size: int) -> RowBatch:
    """One temporary batch over the rows of several (for one shared forward): their caches copied
    side by side (`RowCache.joined`), their pending segments (one clean window size, `clean_block_size`)
    left-padded to a common width. `split` hands the rows back afterwards."""
    first = batches[0]
    out = RowBatch(first.runner, first.width, clean_block_size, first.mask_id, first.device, first.prefill_chunk)
    out.cache = first.cache.joined([b.cache for b in batches[1:]])
    out.pending = _stack_pending([(b.pending, len(b.seqs)) for b in batches], first.device)
    out.seqs = [s for b in batches for s in b.seqs]
    return out


def split(merged: RowBatch, batches: list[RowBatch]) -> None:
    """After a forward of `merge(batches)`: each batch takes its rows of the merged cache back, as views
    (`RowCache.rows_view`: the merged batch is not used again; its pending segment was consumed by that
    forward)."""
    start = 0
    for b in batches:
        n = len(b.seqs)
        b.cache = merged.cache.rows_view(start, n)
        b.pending, start = None, start + n


def left_padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token lists as [rows, longest] ids left-padded with 0, and the padding (None: none)."""
    width = max(map(len, rows), default=0)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    pad = torch.ones(len(rows), width, dtype=torch.bool)
    for r, c in enumerate(rows):
        if c:
            ids[r, width - len(c):] = torch.tensor(c)
            pad[r, width - len(c):] = False
    return ids.to(device), pad.to(device) if bool(pad.any()) else None
