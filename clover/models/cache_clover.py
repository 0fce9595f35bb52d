"""Per-sequence decoding state: attention K/V, GDN conv and recurrent states, one row per sequence.

Only clean (committed) tokens ever enter the cache; draft windows are computed against it and
thrown away. Rows advance independently (`lens` holds each row's committed length). For
self-speculative decoding a forward can *record* what the GDN layers consumed, so that
`rollback(keep)` can rewind every row to any point inside the recorded segment without another
model forward (attention just forgets the tail; GDN states are re-advanced from the snapshot).

Code outside the model's layers goes through the methods: rows (`select_rows`, `append_rows`,
`copy_rows`, `pad_rows`), growth (`reserve`), commits (`advance`), recording (`start_recording`,
`rollback`, `trim_records`) and, for a compiled runner, the tensors a graph reads (`tensors`, `get`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from ..ops.utils import cast
from .cache_rows import RowCache


class GdnRecord(NamedTuple):
    """What one GDN layer consumed in a recorded forward: its states before, and the clean columns'
    conv inputs and delta-rule inputs (`pad`: the segment's left padding, or None)."""

    conv_before: torch.Tensor
    state_before: torch.Tensor
    stream: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    pad: torch.Tensor | None

    def rows(self, n: int) -> "GdnRecord":
        return GdnRecord(*(t[:n] if t is not None else None for t in self))


class CloverCache(RowCache):
    STORES = ("key", "value", "conv", "state")  # the per-layer tensor stores, each {layer: [rows, ...]}

    def __init__(self, config, batch_size: int, capacity: int = 256, device=None, dtype=torch.float32):
        super().__init__(config, batch_size, capacity, device, dtype)
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
        self.recorded: dict[int, GdnRecord] = {}

    # ---- what the layers read and write ------------------------------------------------------
    def commit_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V [B, H, n, D] of the first n (clean) columns scattered to their slots [B, n]."""
        index = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.key[layer].scatter_(2, index, cast(k, self.dtype))
        self.value[layer].scatter_(2, index, cast(v, self.dtype))

    def gdn_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A GDN layer's (conv state [B, C, K-1], recurrent state [B, H, Dk, Dv])."""
        return self.conv[layer], self.state[layer]

    def set_gdn_states(self, layer: int, conv: torch.Tensor, state: torch.Tensor | None) -> None:
        """Written in place: the cache tensors keep their storage and strides (static shapes). `state`
        None: the recurrent state was already updated where it lies (`ops.gated_delta_rule.step_into`)."""
        self.conv[layer].copy_(conv)
        if state is not None:
            self.state[layer].copy_(state)

    # ---- rows ---------------------------------------------------------------------------------
    def copy_rows(self, rows=None) -> "CloverCache":
        """A cache of its own holding `rows` of this one (all rows when None), nothing recorded."""
        out = super().copy_rows(rows)
        out.recorded = {}
        return out

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
        """The next forward records what its GDN layers consume (`record`), for `rollback`."""
        self.recording = True
        self.recorded = {}
        self._record_lens = self.lens.clone()

    def record(self, layer: int, stream, q, k, v, g, beta, pad) -> None:
        """A GDN layer's clean columns of a recorded forward, with its states before it writes them."""
        self.recorded[layer] = GdnRecord(self.conv[layer].clone(), self.state[layer].clone(), stream, q, k, v, g, beta,
                                         pad)

    def trim_records(self, rows: int) -> None:
        """Keep the records of the first `rows` rows (a forward ran with spare rows: `pad_rows`)."""
        self.recorded = {i: rec.rows(rows) for i, rec in self.recorded.items()}

    def rollback(self, keep: torch.Tensor, states=None) -> None:
        """After a recorded forward that committed n tokens per row, keep only the first `keep[b]`.
        The recorded segment may be left-padded (a batch's shorter rows; a compiled runner's bucket,
        compile.bucket): `keep` counts real tokens, after each row's padding. `states`: how
        `rolled_states` is called (a runner's `fuse` of it; default: as it is)."""
        if not self.recording:
            raise RuntimeError("rollback() needs a forward recorded after start_recording()")
        keep = keep.to(self.device)
        self.lens = self._record_lens + keep
        if self.recorded:  # every GDN layer recorded the same columns and padding
            records = list(self.recorded.values())
            pad = records[0].pad
            npad = pad.sum(1) if pad is not None else torch.zeros_like(keep)
            flat = [t for r in records for t in r[:8]]
            out = (states or rolled_states)(keep, npad, *flat)
            for i, state, conv in zip(self.recorded, out[0::2], out[1::2]):
                self.state[i].copy_(state)  # in place, as the forward writes them
                self.conv[i].copy_(conv)
        self.recording = False
        self.recorded = {}


def rolled_states(keep: torch.Tensor, npad: torch.Tensor, *records: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each recorded GDN layer's (recurrent state, conv state) after only the first `keep[b]` real
    tokens of its recorded segment (after `npad[b]` columns of left padding); `records`: eight
    tensors a layer (GdnRecord's fields but the padding). Pure, rows first: a compiled runner makes
    it one graph (`runner.fuse`)."""
    conv_before, _, _, _, k, _, g, _ = records[:8]
    kernel = conv_before.shape[2] + 1
    cols = torch.arange(k.shape[1], device=k.device)[None, :]
    live = ((cols >= npad[:, None]) & (cols < (npad + keep)[:, None])).to(g.dtype)[..., None]
    # the last K-1 inputs of [conv state ; kept tokens], the tokens found after their row's padding
    at = keep[:, None] + torch.arange(kernel - 1, device=k.device)[None, :]
    idx = torch.where(at >= kernel - 1, at + npad[:, None], at)
    out = []
    for j in range(0, len(records), 8):
        conv_before, state_before, stream, q, k, v, g, beta = records[j:j + 8]
        _, state = fused_recurrent_gated_delta_rule(q, k, v, g * live, beta * live, 1.0, state_before)
        full = torch.cat([cast(conv_before, stream.dtype), stream], dim=-1)  # [B, C, K-1+n]
        out += [state, full.gather(2, idx[:, None, :].expand(-1, full.shape[1], -1))]
    return tuple(out)
