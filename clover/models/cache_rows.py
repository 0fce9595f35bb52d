"""What every block-decoding cache does with its rows, whatever its layers store: growth, commits,
row selection and padding for continuous batching, and the tensor paths a compiled graph reads.

A cache keeps per-layer stores named in `STORES`, each {layer: tensor [rows, ...]}; the K/V stores
(`KV`) also have a capacity axis (dim 2) that grows by doubling. `lens` holds each row's committed
length. Clover's cache (cache_clover.py) adds the GDN stores and their records; the published
families' (modeling_family.py) has K/V alone.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..ops.utils import cast

KV = ("key", "value")


class RowCache:
    STORES: tuple[str, ...] = KV

    def __init__(self, config, batch_size: int, capacity: int, device, dtype):
        """The row bookkeeping; a subclass then fills its stores for `batch_size` rows."""
        self.config = config
        self.device = torch.device(device or "cpu")
        self.dtype = dtype
        self.batch_size = batch_size
        self.capacity = capacity
        self.lens = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.recording = False
        self._record_lens: torch.Tensor | None = None

    # ---- growth -------------------------------------------------------------------------------
    def max_len(self) -> int:
        return int(self.lens.max()) if self.batch_size else 0

    def reserve(self, extra: int) -> None:
        """Room for `extra` more committed tokens in every row (grows by doubling)."""
        need = self.max_len() + extra
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity)
        for name in KV:
            store = getattr(self, name)
            for i, t in store.items():
                store[i] = F.pad(t, (0, 0, 0, new_cap - self.capacity))
        self.capacity = new_cap

    def advance(self, committed: torch.Tensor | int) -> None:
        """After a forward wrote its clean columns: each row's committed length grows by `committed`."""
        self.lens = self.lens + committed

    # ---- reads --------------------------------------------------------------------------------
    def kv(self, layer: int, dtype, prefix: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V in `dtype`: the first `prefix` slots, or the whole capacity when None."""
        k, v = self.key[layer], self.value[layer]
        if prefix is not None:
            k, v = k[:, :, :prefix], v[:, :, :prefix]
        return k.to(dtype), v.to(dtype)

    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V [B, H, L, D] of every column written at its slot [B, L], in place (static shapes)."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.key[layer][rows, :, slots] = cast(k.transpose(1, 2), self.dtype)
        self.value[layer][rows, :, slots] = cast(v.transpose(1, 2), self.dtype)

    def extend_kv(self, layer: int, prefix: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a forward attends to, [cache prefix ; new columns], without copying the
        cache: the new columns' K/V [B, H, L, D] are written in place at slots [prefix, prefix + L)
        (past every row's committed length when `prefix` is the longest row's: scratch, which the
        forward's commits overwrite afterwards) and the first prefix + L slots are returned as views.
        The caller reserved L slots (`reserve`)."""
        end = prefix + k.shape[2]
        self.key[layer][:, :, prefix:end].copy_(k)
        self.value[layer][:, :, prefix:end].copy_(v)
        return self.kv(layer, k.dtype, end)

    def tensors(self) -> dict[tuple, torch.Tensor]:
        """Every tensor of the cache by path: ("lens", None) and (store, layer) for each store."""
        out = {("lens", None): self.lens}
        for name in self.STORES:
            out.update({(name, i): t for i, t in getattr(self, name).items()})
        return out

    def get(self, path: tuple) -> torch.Tensor:
        """The tensor at a path of `tensors()`."""
        name, i = path
        return self.lens if name == "lens" else getattr(self, name)[i]

    # ---- rows (continuous batching) ------------------------------------------------------------
    def select_rows(self, rows) -> None:
        """Keep only `rows`, in that order (sequences leaving the batch; a row named twice forks)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        for name in self.STORES:
            store = getattr(self, name)
            for i, t in store.items():
                store[i] = t.index_select(0, rows)
        self.lens = self.lens.index_select(0, rows)
        self.batch_size = len(rows)

    def append_rows(self, other: "RowCache") -> None:
        """Add the rows of another cache (e.g. freshly prefilled requests) after ours."""
        cap = max(self.capacity, other.capacity)
        for name in self.STORES:
            store, ostore = getattr(self, name), getattr(other, name)
            for i in store:
                a, b = store[i], ostore[i]
                if name in KV:
                    a = F.pad(a, (0, 0, 0, cap - a.shape[2]))
                    b = F.pad(b, (0, 0, 0, cap - b.shape[2]))
                store[i] = torch.cat([a, b])
        self.lens = torch.cat([self.lens, other.lens])
        self.capacity = cap
        self.batch_size += other.batch_size

    def copy_rows(self, rows=None) -> "RowCache":
        """A cache of its own holding `rows` of this one (all rows when None)."""
        out = copy.copy(self)
        for name in self.STORES:
            setattr(out, name, dict(getattr(self, name)))
        out.select_rows(rows if rows is not None else torch.arange(self.batch_size, device=self.device))
        return out

    def joined(self, others: list["RowCache"]) -> "RowCache":
        """A cache of its own holding this cache's rows, then each of `others`' in order, nothing recorded:
        one copy of each store (the K/V at the largest capacity) whatever the number of caches."""
        caches = [self, *others]
        out, cap = self._empty(), max(c.capacity for c in caches)
        for name in self.STORES:
            store = getattr(out, name)
            for i in store:
                parts = [getattr(c, name)[i] for c in caches]
                if name in KV:
                    parts = [F.pad(t, (0, 0, 0, cap - t.shape[2])) if t.shape[2] < cap else t for t in parts]
                store[i] = torch.cat(parts)
        out.lens = torch.cat([c.lens for c in caches])
        out.capacity, out.batch_size = cap, sum(c.batch_size for c in caches)
        return out

    def rows_view(self, start: int, n: int) -> "RowCache":
        """A cache of rows [start, start + n) of this one as views, not copies (nothing recorded): its
        forwards write this cache's rows in place, and this cache's other rows never. For handing the
        rows of a shared forward's cache back to their owners (`joined`), which no longer use it."""
        out = self._empty()
        for name in self.STORES:
            store = getattr(out, name)
            for i, t in getattr(self, name).items():
                store[i] = t[start: start + n]
        out.lens = self.lens[start: start + n]
        out.batch_size = n
        return out

    def _empty(self) -> "RowCache":
        """A cache like this one with no rows (the subclass's bookkeeping as `copy_rows` leaves it)."""
        return self.copy_rows(torch.zeros(0, dtype=torch.long, device=self.device))

    def put_rows(self, rows, other: "RowCache") -> None:
        """Write the rows of `other` (a `copy_rows(rows)` of this cache, then advanced) back at `rows`,
        in place; this cache grows first if `other` did."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        if other.capacity > self.capacity:
            self.reserve(other.capacity - self.max_len())
        for name in self.STORES:
            store, ostore = getattr(self, name), getattr(other, name)
            for i, t in store.items():
                src = ostore[i]
                if name in KV and src.shape[2] < t.shape[2]:
                    src = F.pad(src, (0, 0, 0, t.shape[2] - src.shape[2]))
                t.index_copy_(0, rows, src)
        self.lens = self.lens.index_copy(0, rows, other.lens)

    def pad_rows(self, rows: int) -> "RowCache":
        """A cache of `rows` rows whose first rows are this cache's, as views: a forward on it
        writes this cache's rows in place. The spare rows start from length 0 and are never read by a
        real row. This cache's tensors are re-homed once (after rows joined, left or the capacity
        grew) as the first rows of tensors of `rows` rows, so later calls reuse them. Everything else
        (records included) is shared with this cache."""
        real = self.batch_size
        out = copy.copy(self)
        for name in self.STORES:
            store, full = getattr(self, name), {}
            for i, t in store.items():
                base = t._base
                if (base is None or not getattr(base, "spare_rows", False) or base.shape[0] != rows
                        or base.shape[1:] != t.shape[1:] or base.data_ptr() != t.data_ptr()):
                    base = t.new_zeros((rows, *t.shape[1:]))
                    base.spare_rows = True  # made here: its rows past this cache's are spare (not another's, `rows_view`)
                    base[:real].copy_(t)
                    store[i] = base[:real]
                full[i] = base
            setattr(out, name, full)
        out.lens = F.pad(self.lens, (0, rows - real))
        out.batch_size = rows
        return out
