"""The shapes a compiled step is made for: which calls are steady, the column and row buckets a
call is padded to, and the key that names one graph."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

STEADY_MAX = 64  # widest clean segment and window a compiled graph takes (also the compiled prefill chunk)
CAPACITY_BUCKET = 256  # compiled caches hold a multiple of this many tokens per row
SPAN_MIN = 64  # the fewest cache slots a span-limited graph's attention reads (`attention_span`)


class ShapeKey(NamedTuple):
    """Everything a compiled step specialises on besides the (fixed) weights: one graph, one Replay."""

    shape: tuple  # the ids' [rows, columns]
    device: torch.device
    draft_len: int
    clean_block_size: int
    block: int
    no_pad: bool
    recording: bool
    capacity: int
    rows: int  # the cache's rows
    dtype: torch.dtype  # the cache's dtype
    logits_to_keep: int
    grad: bool
    inference: bool
    span: int = 0  # cache slots the attention reads (0: the whole capacity; `attention_span`)
    sub_block_head: bool = False  # a sub-block step's draft (engine/batch.Forward): other columns' logits 0
    head: int = 0  # columns a masked-head step computes (the model's `head_width`; 0: every kept column)


def shape_key(ids, pad_mask, cache, logits_to_keep: int, draft_len: int, clean_block_size: int,
              block: int, span: int = 0, sub_block_head: bool = False) -> ShapeKey:
    return ShapeKey(tuple(ids.shape), ids.device, draft_len, clean_block_size, block, pad_mask is None,
                    cache.recording, cache.capacity, cache.batch_size, cache.dtype, logits_to_keep,
                    torch.is_grad_enabled(), torch.is_inference_mode_enabled(), span, sub_block_head)


def attention_span(used: int, capacity: int) -> int:
    """The cache slots a span-limited step reads when its rows use the first `used` (committed
    tokens and the step's own columns): a power of two from SPAN_MIN, at most the capacity. A graph
    per span, so the attention of a short sequence does not read the whole capacity bucket."""
    if used > capacity:
        raise ValueError(f"a step using {used} cache slots does not fit the capacity {capacity}")
    return min(_next_pow2(max(used, SPAN_MIN)), capacity)


def is_steady(num_clean: int, length: int) -> bool:
    """Shapes a steady decode repeats (compiled): no clean column or one (AR), or a clean block of a
    power-of-two size up to 64, with a window of at most 64. Other clean widths up to 64 (prefill
    chunks, a prompt's tail fused with the first window) are left-padded to a bucket (`bucket`);
    wider ones run eagerly."""
    return num_clean <= STEADY_MAX and length - num_clean <= STEADY_MAX and num_clean & (num_clean - 1) == 0


def bucket_width(n: int) -> int:
    """The columns (or rows) a compiled graph is made for, for a call of n: powers of two up to 16,
    then multiples of 8. A step's cost grows with its rows in steps of a CPU's vector tiles, so
    finer buckets past 16 pay for fewer rows nobody asked for."""
    return _next_pow2(n) if n <= 16 else -(-n // 8) * 8


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def bucket(ids, pad, num_clean: int):
    """(ids, pad, num_clean) of a call that is not steady, with the clean segment left-padded so the
    call's columns are a `bucket_width`, or to the next power of two (steady), whichever is narrower
    (a clean segment of at most 64 columns): padded columns are masked like a shorter row's in a
    batch (the model's pad_mask), so the logits of the real columns are those of the unpadded call;
    None where even the padded shape is not steady (it stays eager)."""
    window = ids.shape[1] - num_clean
    widths = [w for w in (bucket_width(ids.shape[1]) - window, _next_pow2(num_clean)) if w <= STEADY_MAX]
    if not widths or window > STEADY_MAX:
        return None
    width = min(widths)
    extra = width - num_clean
    pad = pad if pad is not None else torch.zeros_like(ids, dtype=torch.bool)
    return F.pad(ids, (extra, 0)), F.pad(pad, (extra, 0), value=True), width


def pad_rows(ids, pad, cache, rows: int):
    """(ids, pad, cache) of a call of fewer rows than its graph's (`rows`, a `bucket_width`: a batch
    of 3, 5, 6 or 7 rows replays the graph of 4 or 8 instead of compiling its own), with spare rows
    after the real ones: token 0, no padding, a cache row of their own (`cache.pad_rows`): rows never
    mix, and the spare rows' logits and lengths are dropped. Unchanged when the call has `rows` rows."""
    real = ids.shape[0]
    if real == rows:
        return ids, pad, cache
    spare = rows - real
    ids = F.pad(ids, (0, 0, 0, spare))
    pad = F.pad(pad, (0, 0, 0, spare)) if pad is not None else None
    return ids, pad, cache.pad_rows(rows)


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` with the strides of a new tensor of its shape. A graph and its Replay are made for the
    strides they were called with, and a slice of a wider tensor (a prompt chunk) keeps its row
    stride even at one row: the same shape would come with other strides and miss its Replay."""
    if t is None or t.stride() == _contiguous_strides(t.shape):
        return t
    return t.new_empty(t.shape).copy_(t)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def layout_of(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device
