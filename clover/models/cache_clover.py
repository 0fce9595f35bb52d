"""Per-sequence decoding state: attention K/V, GDN conv and recurrent states, one row per sequence.

Only clean (committed) tokens ever enter the cache; draft windows are computed against it and
thrown away. Rows advance independently (`lens` holds each row's committed length). For
self-speculative decoding a forward can *record* what the GDN layers consumed, so that
`rollback(keep)` can rewind every row to any point inside the recorded segment without another
model forward (attention just forgets the tail; GDN states are re-advanced from the snapshot).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from ..ops.utils import cast


class CloverCache:
    def __init__(self, config, batch_size: int, capacity: int = 256, device=None, dtype=torch.float32):
        self.config = config
        self.device = torch.device(device or "cpu")
        self.dtype = dtype
        self.batch_size = batch_size
        self.capacity = capacity
        self.lens = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.key: dict[int, torch.Tensor] = {}
        self.value: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}
        c = config
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        for i, kind in enumerate(c.layer_types):
            if kind == "full_attention":
                shape = (batch_size, c.num_key_value_heads, capacity, c.head_dim)
                self.key[i] = torch.zeros(shape, dtype=dtype, device=self.device)
                self.value[i] = torch.zeros(shape, dtype=dtype, device=self.device)
            else:
                self.conv[i] = torch.zeros(batch_size, conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype, device=self.device)
                self.state[i] = torch.zeros(
                    batch_size, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                    dtype=torch.float32, device=self.device,
                )
        self.recording = False
        self.recorded: dict[int, tuple] = {}
        self._record_lens: torch.Tensor | None = None

    # ---- growth -------------------------------------------------------------------------------
    def reserve(self, extra: int) -> None:
        """Make room for `extra` more committed tokens in every row (grows by doubling)."""
        need = int(self.lens.max()) + extra
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity)
        for store in (self.key, self.value):
            for i, t in store.items():
                store[i] = F.pad(t, (0, 0, 0, new_cap - self.capacity))
        self.capacity = new_cap

    def max_len(self) -> int:
        return int(self.lens.max()) if self.batch_size else 0

    # ---- rows (continuous batching) ------------------------------------------------------------
    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only `rows` (in that order); used when sequences leave the running batch."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        for store in (self.key, self.value, self.conv, self.state):
            for i, t in store.items():
                store[i] = t.index_select(0, rows)
        self.lens = self.lens.index_select(0, rows)
        self.batch_size = len(rows)

    def append_rows(self, other: "CloverCache") -> None:
        """Add the rows of another cache (e.g. freshly prefilled requests) after ours."""
        cap = max(self.capacity, other.capacity)
        for store, ostore in ((self.key, other.key), (self.value, other.value)):
            for i in store:
                a, b = store[i], ostore[i]
                a = F.pad(a, (0, 0, 0, cap - a.shape[2]))
                b = F.pad(b, (0, 0, 0, cap - b.shape[2]))
                store[i] = torch.cat([a, b])
        for store, ostore in ((self.conv, other.conv), (self.state, other.state)):
            for i in store:
                store[i] = torch.cat([store[i], ostore[i]])
        self.lens = torch.cat([self.lens, other.lens])
        self.capacity = cap
        self.batch_size += other.batch_size

    # ---- snapshot / rollback ------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Copy of everything a rollback to this point needs (K/V entries past `lens` are never read)."""
        return {
            "lens": self.lens.clone(),
            "conv": {i: t.clone() for i, t in self.conv.items()},
            "state": {i: t.clone() for i, t in self.state.items()},
        }

    def restore(self, snap: dict) -> None:
        self.lens = snap["lens"].clone()
        for i in self.conv:  # in place: the cache tensors keep their storage (static shapes)
            self.conv[i].copy_(snap["conv"][i])
            self.state[i].copy_(snap["state"][i])

    def start_recording(self) -> None:
        self.recording = True
        self.recorded = {}
        self._record_lens = self.lens.clone()

    def rollback(self, keep: torch.Tensor) -> None:
        """After a recorded forward that committed n tokens per row, keep only the first `keep[b]`.
        The recorded segment may be left-padded (a batch's shorter rows; a compiled runner's bucket,
        engine/runner.bucket): `keep` counts real tokens, after each row's padding."""
        if not self.recording:
            raise RuntimeError("rollback() needs a forward recorded after start_recording()")
        keep = keep.to(self.device)
        self.lens = self._record_lens + keep
        kernel = self.config.linear_conv_kernel_dim
        if self.recorded:  # every GDN layer recorded the same columns and padding: one mask and one index for all
            _, _, _, _, k, _, g, _, pad = next(iter(self.recorded.values()))
            npad = pad.sum(1) if pad is not None else torch.zeros_like(keep)
            cols = torch.arange(k.shape[1], device=self.device)[None, :]
            live = ((cols >= npad[:, None]) & (cols < (npad + keep)[:, None])).to(g.dtype)[..., None]
            # the last K-1 inputs of [conv state ; kept tokens], the tokens found after their row's padding
            at = keep[:, None] + torch.arange(kernel - 1, device=self.device)[None, :]
            idx = torch.where(at >= kernel - 1, at + npad[:, None], at)
        for i, (conv_before, state_before, stream, q, k, v, g, beta, _) in self.recorded.items():
            _, state = fused_recurrent_gated_delta_rule(q, k, v, g * live, beta * live, 1.0, state_before)
            self.state[i].copy_(state)  # in place, as the forward writes them
            full = torch.cat([cast(conv_before, stream.dtype), stream], dim=-1)  # [B, C, K-1+n]
            self.conv[i].copy_(full.gather(2, idx[:, None, :].expand(-1, full.shape[1], -1)))
        self.recording = False
        self.recorded = {}
