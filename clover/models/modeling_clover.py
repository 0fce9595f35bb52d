"""Clover: a Qwen3-Next / Qwen3.5-MoE hybrid backbone (Gated DeltaNet + gated attention, sparse MoE)
that decodes by block diffusion. Formulas and design choices: docs/architecture.md.

One forward serves every use:
* AR (no block arguments): a causal LM; with the diffusion additions at their initial values it
  equals transformers' Qwen3NextForCausalLM.
* Stream (`draft_len`, `block_size`, optional `cache`): `input_ids` = [clean tokens ; one draft
  window]. Clean tokens are cut into windows of `clean_block_size` anchored at the end of the clean
  segment (the first window may be partial) and committed to the cache; the draft window (the last
  `draft_len` tokens, noisy, block size `block_size`) sees the whole clean prefix and itself.
* Training layout (`noisy_input_ids`): [x_t ; x_0] in one pass; noisy window k sees clean windows
  < k and itself. Equal to running the windows one by one through the stream path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import ModelOutput

from ..ops.block_attention import local_window_attention, masked_attention
from ..ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_from_states,
    gated_delta_rule,
    step_into,
)
from ..ops.moe import TILED_PAIRS, experts, tiled_from
from ..ops.short_conv import block_short_conv
from ..ops.utils import cast
from ..quant import apply_quantization
from .cache_clover import CloverCache
from .configuration_clover import CloverConfig, calibration_weights


# ------------------------------------------------------------------------------------------------
# Layout of one forward pass
# ------------------------------------------------------------------------------------------------
def window_ids(length: int, block: int, device=None) -> torch.Tensor:
    """Window index per position, windows anchored at the END (the first window may be partial).
    Counted with a cumsum over window starts rather than divided: inductor keeps a scan's result as
    a buffer its kernels load, where a division would be recomputed per element of every kernel
    that reads the ids (scalar integer division in the GDN conv)."""
    pad = (-length) % block
    starts = (torch.arange(length, device=device) + pad) % block == 0
    return starts.long().cumsum(0) - (0 if pad else 1)


@dataclass
class Layout:
    """Everything the layers need to know about how the tokens of one forward relate."""

    wid: torch.Tensor  # [L] window id per column (stream) or per clean column (training)
    positions: torch.Tensor  # [B, L] RoPE positions
    attn_mask: torch.Tensor  # [B, 1, Lq, Lk] for the attention layers (keys: cache prefix + new)
    bidir_mask: torch.Tensor | None  # [B, 1, Lq, Lq] same-window mask for the GDN softmax branch
    calib: torch.Tensor | None  # [L(q), A] calibration interpolation weights per column ([B, L, A] with `draft_lens`)
    num_clean: int  # stream: committed columns (the rest is the draft window)
    pad: torch.Tensor | None  # [B, L] left padding of the clean segment (stream only)
    training: bool = False  # [x_t ; x_0] layout: first half noisy, second half clean
    clean_block_size: int = 1  # window size of the clean columns (the chunk size of the training layout)
    prefix: int = 0  # cache slots the attention layers read (the longest row's committed length)
    slots: torch.Tensor | None = None  # static: [B, L] the cache slot each column's K/V is written to
    rope: tuple | None = None  # (cos, sin), computed by the first attention layer, shared by the rest
    window: int = 0  # every window has this many columns (anchored at the end): the GDN branch runs per window
    unseen: torch.Tensor | None = None  # [B, L] columns no other column reads: `pad` and a ragged draft tail (`draft_lens`)

    def rope_for(self, rotary_dim: int, theta: float, dtype):
        if self.rope is None:
            self.rope = rope_cos_sin(self.positions, rotary_dim, theta, dtype)
        return self.rope


def _calibration_row(block_size: int, anchors: int, device) -> torch.Tensor:
    # a fresh tensor each call (the weights are a few floats): one cached while torch.inference_mode
    # was on could never be saved for backward afterwards (generate, then train, in one process)
    return torch.tensor(calibration_weights(block_size, anchors), device=device)


def _calibration_rows(cfg: CloverConfig, sizes: list[tuple[int, int]], device) -> torch.Tensor | None:
    """Per-column interpolation weights [L, A] for (count, block_size) runs; None when all are 0."""
    if all(bs <= 1 or n == 0 for n, bs in sizes):
        return None
    rows = [_calibration_row(bs, cfg.num_calibration_anchors, device).expand(n, -1) for n, bs in sizes if n]
    return torch.cat(rows) if len(rows) > 1 else rows[0]


def _ragged_calibration(cfg, num_clean, clean_block_size, draft_len, draft_lens, device) -> torch.Tensor:
    """Per-row calibration weights [B, L, A]: row r's draft window has block size `draft_lens[r]`."""
    zeros = torch.zeros(num_clean + draft_len, cfg.num_calibration_anchors, device=device)
    rows = [_calibration_rows(cfg, [(num_clean, clean_block_size), (draft_len, w)], device) for w in draft_lens]
    return torch.stack([zeros if r is None else r for r in rows])


def _ragged_tail(draft_lens, draft_len, length, device) -> torch.Tensor:
    """[B, L]: the columns of the draft window (the last `draft_len`) past each row's own width."""
    lens = torch.tensor(draft_lens, device=device)
    col = torch.arange(length, device=device) - (length - draft_len)
    return col[None, :] >= lens[:, None]


def stream_layout(cfg, batch, length, draft_len, clean_block_size, draft_bs, cache, pad, device, static: bool = False,
                  draft_lens: list[int] | None = None) -> Layout:
    """`draft_lens` (eager only): each row's own draft width and block size; its window is the first that many
    columns of the draft (the rest right padding that none of its columns reads, so each row computes what
    it would alone up to rounding).

    `static`: the attention layers write every column's K/V into the cache in place (clean columns at
    their commit slots, draft columns in the scratch slots after them, past the row's new length,
    which no later query reads) and attend over the cache's whole capacity, masked past each row's
    length: shapes stay fixed while rows grow (compiled runner), no host sync reads
    the lengths and no step copies the cache (a cat of prefix and new keys would)."""
    num_clean = length - draft_len
    wid = window_ids(num_clean, clean_block_size, device)
    if draft_len:
        first_draft = -(-num_clean // clean_block_size)  # the clean windows' count (no host sync: traceable)
        wid = torch.cat([wid, torch.full((draft_len,), first_draft, device=device)])
    lens = cache.lens if cache is not None else torch.zeros(batch, dtype=torch.long, device=device)
    npad = pad.sum(1) if pad is not None else torch.zeros(batch, dtype=torch.long, device=device)
    cols = torch.arange(length, device=device)
    positions = (lens[:, None] + cols[None, :] - npad[:, None]).clamp_min(0)
    ragged = _ragged_tail(draft_lens, draft_len, length, device) if draft_lens is not None else None
    unseen = pad if ragged is None else ragged if pad is None else pad | ragged
    valid = ~unseen if unseen is not None else torch.ones(batch, length, dtype=torch.bool, device=device)
    new = (wid[None, :] <= wid[:, None])[None] & valid[:, None, :]  # [B, Lq, Lk]
    same = (wid[None, :] == wid[:, None])[None] & valid[:, None, :]
    if unseen is not None:  # padded queries look at themselves only, so no row is empty
        eye = torch.eye(length, dtype=torch.bool, device=device)[None] & unseen[:, :, None]
        new, same = new | eye, same | eye
    prefix = (cache.capacity if static else cache.max_len()) if cache is not None else 0
    slots = None
    if prefix:
        old = (torch.arange(prefix, device=device)[None, :] < lens[:, None])[:, None, :].expand(-1, length, -1)
        if static:  # keys = the cache itself: each column's mask entries move to its slot
            slots = commit_slots(lens, pad, length)  # draft columns land past the new length: scratch
            new = old.scatter(2, slots[:, None, :].expand(-1, length, -1), new)
        else:
            new = torch.cat([old, new], dim=-1)
    calib = _calibration_rows(cfg, [(num_clean, clean_block_size), (draft_len, draft_bs)], device) \
        if draft_lens is None else _ragged_calibration(cfg, num_clean, clean_block_size, draft_len, draft_lens, device)
    # one window size throughout (a prompt chunk; a window alone or with the block it commits)
    window = draft_len if not num_clean else clean_block_size if draft_len in (0, clean_block_size) else 0
    return Layout(wid, positions, new[:, None], same[:, None] if calib is not None and not window else None, calib,
                  num_clean, pad, clean_block_size=clean_block_size, prefix=prefix, slots=slots, window=window,
                  unseen=unseen)


def training_layout(cfg, batch, length, block, device) -> Layout:
    wid = window_ids(length, block, device)
    positions = torch.arange(length, device=device).repeat(2)[None].expand(batch, -1)
    same = wid[None, :] == wid[:, None]
    earlier = wid[None, :] < wid[:, None]
    upto = same | earlier
    top = torch.cat([same, earlier], dim=1)  # noisy queries: own noisy window + earlier clean windows
    bottom = torch.cat([torch.zeros_like(same), upto], dim=1)  # clean queries: block-causal clean
    mask = torch.cat([top, bottom])[None, None].expand(batch, -1, -1, -1)
    calib = _calibration_rows(cfg, [(2 * length, block)], device)
    bidir = torch.block_diag(same, same)[None, None].expand(batch, -1, -1, -1) if calib is not None else None
    return Layout(wid, positions, mask, bidir, calib, length, None, training=True, clean_block_size=block)


# ------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------
class CloverRMSNorm(nn.Module):
    """Zero-centred RMSNorm: x / rms(x) * (1 + w), computed in fp32 (one fused kernel)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        out = F.rms_norm(_fp32(x), x.shape[-1:], 1.0 + _fp32(self.weight), self.eps)
        return out if out.dtype == x.dtype else out.to(x.dtype)


class CloverGatedRMSNorm(nn.Module):
    """GDN output norm: w * x / rms(x) * silu(z) (weight initialised to one, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        normed = F.rms_norm(_fp32(x), x.shape[-1:], None, self.eps).to(x.dtype) * self.weight
        return (_fp32(normed) * F.silu(_fp32(z))).to(x.dtype)


def _fp32(x):
    return cast(x, torch.float32)


def rope_frequencies(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """[rotary_dim / 2] fp32 RoPE inverse frequencies (as transformers computes them)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_cos_sin(positions, rotary_dim, theta, dtype, inv_freq=None):
    """(cos, sin) [..., rotary_dim] at `positions`; `inv_freq`: the frequencies made once (a model's
    buffer) instead of computed here."""
    if inv_freq is None:
        inv_freq = rope_frequencies(rotary_dim, theta, positions.device)
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x, cos, sin):
    """x [B, H, L, D]; rotates the first cos.shape[-1] dims (rotate-half convention)."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class CloverAttention(nn.Module):
    """Gated GQA attention: q/k RMSNorm, partial RoPE, sigmoid output gate. One fused input
    projection, rows [query (H*D) ; gate (H*D) ; key (Hkv*D) ; value (Hkv*D)]."""

    def __init__(self, config: CloverConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.rotary_dim, self.theta = config.rotary_dim, config.rope_theta
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.split = (q_dim, q_dim, kv_dim, kv_dim)
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split), bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = CloverRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = CloverRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, layout: Layout, cache: CloverCache | None, keep: int = 0):
        batch, length, _ = x.shape
        q, gate, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = self.q_norm(q.view(batch, length, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(batch, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = layout.rope_for(self.rotary_dim, self.theta, q.dtype)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        keys, values = k, v
        if cache is not None and layout.slots is not None:  # static: written in place, then read whole
            cache.write_kv(self.layer_idx, layout.slots, k, v)
            keys, values = cache.kv(self.layer_idx, k.dtype)
        elif cache is not None and layout.prefix:  # [prefix ; new] in the cache's own storage, no copy of it
            keys, values = cache.extend_kv(self.layer_idx, layout.prefix, k, v)
        mask = layout.attn_mask
        if keep and keep < length:  # only these columns' outputs are read (K/V above are every column's)
            q, gate, mask, length = q[:, :, -keep:], gate[:, -keep:], mask[:, :, -keep:], keep
        out = masked_attention(q, keys, values, mask, self.head_dim**-0.5)
        if cache is not None and layout.slots is None and layout.num_clean:  # after reading the scratch slots
            n = layout.num_clean
            cache.commit_kv(self.layer_idx, commit_slots(cache.lens, layout.pad, n), k[:, :, :n], v[:, :, :n])
        out = out.transpose(1, 2).reshape(batch, length, -1) * torch.sigmoid(gate)
        return self.o_proj(out)


def commit_slots(lens: torch.Tensor, pad: torch.Tensor | None, n: int) -> torch.Tensor:
    """Cache slot per clean column [B, n], without `nonzero` (no host sync, static shapes): a real
    column goes to its position; the row's left pads go, in order, to the slots right after its new
    length, which no query reads (K/V past `lens` are masked) and later commits overwrite. Every
    slot is < lens + n <= capacity (the forward reserved n) and distinct within a row."""
    cols = torch.arange(n, device=lens.device)[None, :]
    if pad is None:
        return lens[:, None] + cols
    npad = pad[:, :n].sum(1, keepdim=True)
    return lens[:, None] + torch.where(pad[:, :n], n - npad + cols, cols - npad)


def fresh_decay(heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dt_bias, A_log) of a fresh model, as Mamba2 / flash-linear-attention draw them: A ~ U(1, 16)
    and the step dt = softplus(dt_bias) log-uniform in [1e-3, 0.1], so the per-token decay
    exp(-A dt) starts between ~0.2 and ~1 and the state remembers. Qwen3-Next's modeling file sets
    dt_bias = 1, harmless for converted checkpoints, but a fresh model then forgets nearly everything
    after one token (exp(-A softplus(1)) < 0.3 for every head, < 1e-4 for most)."""
    dt = torch.empty(heads).uniform_(math.log(1e-3), math.log(0.1)).exp()
    return dt + torch.log(-torch.expm1(-dt)), torch.empty(heads).uniform_(1, 16).log()


class CloverGatedDeltaNet(nn.Module):
    """Block-diffusion Gated DeltaNet ("add" reading, docs/architecture.md):

        o = DeltaRule_causal(q, k, v; prefix state) + c(B) * softmax_block(s * q k^T) v

    The causal recurrence runs through the current block as in the AR model; the bidirectional
    softmax branch over the block is scaled by a learnable per-head calibration c(B) (zero at
    init, interpolated over log2 block-size anchors, identically 0 for B = 1); the short conv gains a
    zero-initialised right-side branch restricted to the block. At init this is exactly the AR GDN.
    One fused input projection, rows [q (Kd) ; k (Kd) ; v (Vd) ; z (Vd) ; b (Hv) ; a (Hv)].
    """

    def __init__(self, config: CloverConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.k_heads, self.v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = c.linear_conv_kernel_dim
        self.split = (self.conv_dim, self.value_dim, self.v_heads, self.v_heads)
        self.in_proj = nn.Linear(c.hidden_size, sum(self.split), bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)
        dt_bias, a_log = fresh_decay(self.v_heads)
        self.dt_bias, self.A_log = nn.Parameter(dt_bias), nn.Parameter(a_log)
        self.norm = CloverGatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c.hidden_size, bias=False)
        # --- block-diffusion additions (identity at init) ---
        self.right_conv = nn.Parameter(torch.zeros(self.conv_dim, self.kernel - 1))
        self.block_calibration = nn.Parameter(torch.zeros(c.num_calibration_anchors, self.v_heads))
        self.bidir_log_scale = nn.Parameter(torch.full((self.v_heads,), 0.5 * math.log(self.dk)))

    # ---- pieces shared by both layouts ----
    def _project(self, x):
        mixed, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        return mixed, z, b, a

    def _qkv(self, conv_out, b, a):
        """Conv output [B, C, L] -> per-v-head q, k (L2-normed), v, decay g and beta. SiLU runs
        before the transpose to [B, L, C]: on the transposed view its backward takes a slow strided path."""
        act = F.silu(conv_out).transpose(1, 2)
        batch, length, _ = act.shape
        qk, v = act.split((2 * self.key_dim, self.value_dim), dim=-1)
        rep = self.v_heads // self.k_heads
        qk = l2norm(_fp32(qk.reshape(batch, length, 2, self.k_heads, self.dk)))  # q and k heads normed at once
        if rep > 1:
            qk = qk.repeat_interleave(rep, dim=3)
        q, k = qk.unbind(2)
        v = v.reshape(batch, length, self.v_heads, self.dv)
        g = -_fp32(self.A_log).exp() * F.softplus(_fp32(a) + _fp32(self.dt_bias))
        return q, k, v, g, _fp32(b).sigmoid()

    def _bidirectional(self, q, k, v, layout):
        """c(B) * softmax(s q.k) v within each block; None when every calibration weight is 0."""
        if layout.calib is None:
            return None
        coef = layout.calib.to(self.block_calibration.dtype) @ self.block_calibration  # [L, Hv]
        scale = self.bidir_log_scale.exp().float()
        coef = (coef if coef.dim() == 3 else coef[None]).float()[..., None]  # [1 or B, L, Hv, 1]
        if layout.window:  # equal windows: each one's own scores, not a masked row over the whole length
            valid = ~layout.unseen if layout.unseen is not None else None
            out = local_window_attention(q * scale[None, None, :, None], k, v, valid, layout.window)
            return out * coef
        qs = (q * scale[None, None, :, None]).transpose(1, 2)
        out = masked_attention(qs, k.transpose(1, 2), v.float().transpose(1, 2), layout.bidir_mask, 1.0)
        return out.transpose(1, 2) * coef

    def _finish(self, core, z, extra):
        batch, length = z.shape[:2]
        if extra is not None:
            core = core.float() + extra
        core = cast(core, z.dtype).reshape(batch, length, self.v_heads, self.dv)
        core = self.norm(core, z.reshape(batch, length, self.v_heads, self.dv))
        return self.out_proj(core.reshape(batch, length, self.value_dim))

    def _conv_weight(self):
        return self.conv1d.weight.squeeze(1)

    # ---- stream layout: [clean segment ; draft window] against the cache ----
    def forward(self, x, layout: Layout, cache: CloverCache | None, keep: int = 0):
        if layout.training:
            return self._forward_training(x, layout)
        batch, length, _ = x.shape
        mixed, z, b, a = self._project(x)
        pad = layout.pad
        if layout.unseen is not None:  # the ragged tail too: the right conv of a row's last columns reads zeros
            mixed = mixed.masked_fill(layout.unseen[..., None], 0.0)
        stream = mixed.transpose(1, 2)  # [B, C, L]
        conv_state, state = cache.gdn_states(self.layer_idx) if cache is not None else (None, None)
        left = cast(conv_state, stream.dtype) if cache is not None else stream.new_zeros(batch, self.conv_dim, self.kernel - 1)
        ext = torch.cat([left, stream], dim=-1)
        if pad is not None:  # move the conv state right in front of each row's first real token
            ext = _left_context(ext, pad, self.kernel)
        # windows of one column (AR) have no right context: skip the branch that would add zeros
        right = self.right_conv if layout.calib is not None else None
        conv = block_short_conv(ext, self._conv_weight(), right, layout.wid)
        q, k, v, g, beta = self._qkv(conv, b, a)
        if pad is not None:
            real = (~pad).float()[..., None]
            g, beta = g * real, beta * real
        n = layout.num_clean
        outs = []
        if n:
            # an AR step on a cache not recording: the state updated where it lies, where a kernel does that
            out = step_into(q, k, v, g, beta, self.dk**-0.5, state) if n == length and cache is not None \
                and not cache.recording else None
            in_place = out is not None
            if not in_place:
                out, state = gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], self.dk**-0.5, state)
            outs.append(out)
            if cache is not None:
                if cache.recording:
                    cache.record(self.layer_idx, stream[..., :n], q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n],
                                 pad[:, :n] if pad is not None else None)
                cache.set_gdn_states(self.layer_idx, ext[..., n : n + self.kernel - 1], None if in_place else state)
        if n < length:
            out, _ = gated_delta_rule(q[:, n:], k[:, n:], v[:, n:], g[:, n:], beta[:, n:], self.dk**-0.5, state,
                                      output_final_state=False)
            outs.append(out)
        core = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        extra = self._bidirectional(q, k, v, layout)
        if keep and keep < length:  # only these columns' outputs are read (the states above took every column)
            core, z, extra = core[:, -keep:], z[:, -keep:], extra[:, -keep:] if extra is not None else None
        return self._finish(core, z, extra)

    # ---- training layout: [x_t ; x_0] ----
    def _forward_training(self, x, layout: Layout):
        length = x.shape[1] // 2
        block = layout.clean_block_size
        mixed, z, b, a = self._project(x)
        noisy, clean = mixed[:, :length].transpose(1, 2), mixed[:, length:].transpose(1, 2)
        zeros = clean.new_zeros(clean.shape[0], self.conv_dim, self.kernel - 1)
        clean_ext = torch.cat([zeros, clean], dim=-1)
        conv_clean = block_short_conv(clean_ext, self._conv_weight(), self.right_conv, layout.wid)
        # noisy column t sees, j steps to its left, the noisy token if it is in t's block, else the clean one
        wid = layout.wid
        cols = torch.arange(length, device=x.device)
        w = self._conv_weight()
        conv_noisy = block_short_conv(torch.cat([zeros, noisy], dim=-1), torch.zeros_like(w), self.right_conv, wid)
        for j in range(self.kernel):
            shift = self.kernel - 1 - j  # tap j multiplies input t - shift
            src = cols - shift
            in_block = (src >= 0) & (wid[src.clamp_min(0)] == wid)
            tap = torch.where(in_block[None, None, :], noisy[..., src.clamp_min(0)], clean_ext[..., src + self.kernel - 1])
            conv_noisy = conv_noisy + w[:, j : j + 1].to(tap.dtype) * tap
        conv = torch.cat([conv_noisy, conv_clean], dim=-1)
        q, k, v, g, beta = self._qkv(conv, b, a)
        scale = self.dk**-0.5
        sl = slice(length, None)
        out_clean, _, starts = chunk_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale,
                                                      chunk_size=block)
        ns = slice(0, length)
        out_noisy = chunk_gated_delta_rule_from_states(q[:, ns], k[:, ns], v[:, ns], g[:, ns], beta[:, ns], scale,
                                                       starts, block)
        core = torch.cat([out_noisy, out_clean], dim=1)
        return self._finish(core, z, self._bidirectional(q, k, v, layout))


def _left_context(ext: torch.Tensor, pad: torch.Tensor, kernel: int) -> torch.Tensor:
    """[conv_state ; pads ; tokens] -> [pads ; conv_state ; tokens] per row (pads are a left prefix,
    their columns already zero). Masks and K-1 broadcast products rather than a gather: a gather's
    index, computed per element, keeps inductor's fused kernel scalar."""
    batch, length = pad.shape
    npad = pad.sum(1, keepdim=True)[:, None, :]  # [B, 1, 1]
    i = torch.arange(kernel - 1 + length, device=pad.device)
    out = ext * (i >= npad + kernel - 1).to(ext.dtype)  # the tokens stay where they are
    for s in range(kernel - 1):  # conv state column s moves to column npad + s
        out = out + ext[..., s : s + 1] * (i == npad + s).to(ext.dtype)
    return out


class CloverSparseMoe(nn.Module):
    """Top-k routed experts (fp32 softmax router, renormalised) plus a sigmoid-gated shared expert."""

    def __init__(self, config: CloverConfig):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k, self.norm_topk = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = CloverExperts(e, h, i)
        si = config.shared_expert_intermediate_size
        self.shared_expert = CloverMLP(h, si) if si else None
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if si else None

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(_fp32(self.gate(flat)), dim=-1)
        top_w, top_idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        out = self.experts(flat, top_idx, cast(top_w, flat.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(shape)


class CloverExperts(nn.Module):
    """Routed SwiGLU experts, fused weights. Owns its dispatch so a quantised twin can replace it."""

    tiled_pairs = TILED_PAIRS  # pairs from which a compiled CPU graph runs the tiled op (ops.moe.experts)

    def __init__(self, num_experts, hidden, inter):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def prepare_for_graphs(self) -> None:
        """Before a compiled runner traces the model: the kernel choice that depends on the weights' values."""
        self.tiled_pairs = tiled_from(self.gate_up_proj, self.down_proj)

    def forward(self, x, top_idx, top_w):
        return experts(x, top_idx, top_w, self.gate_up_proj, self.down_proj, self.tiled_pairs)


class CloverMLP(nn.Module):
    """SwiGLU MLP with a fused gate/up projection (rows [gate ; up])."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class CloverDecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, layer_idx: int):
        super().__init__()
        self.kind = config.layer_types[layer_idx]
        if self.kind == "full_attention":
            self.self_attn = CloverAttention(config, layer_idx)
        else:
            self.linear_attn = CloverGatedDeltaNet(config, layer_idx)
        self.mlp = CloverSparseMoe(config)
        self.input_layernorm = CloverRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = CloverRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, layout, cache, keep: int = 0):
        """`keep` > 0: only the last `keep` columns come out (the last layer of a forward that reads
        no other column's output: the mixer still writes every column's K/V or state to the cache)."""
        mixer = self.self_attn if self.kind == "full_attention" else self.linear_attn
        h = mixer(self.input_layernorm(x), layout, cache, keep)
        x = (x[:, -keep:] if keep and keep < x.shape[1] else x) + h
        return x + self.mlp(self.post_attention_layernorm(x))


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------
@dataclass
class CloverOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


class CloverPreTrainedModel(PreTrainedModel):
    config_class = CloverConfig
    config: CloverConfig
    base_model_prefix = "model"
    _no_split_modules = ["CloverDecoderLayer"]
    _supports_sdpa = True

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, with the weight files given the mode the umask gives a new
        file (safetensors writes them 0600; a model folder should read like its config.json)."""
        from pathlib import Path

        from ..utils.files import keep_umask_mode

        out = super().save_pretrained(save_directory, *args, **kwargs)
        keep_umask_mode(*Path(save_directory).glob("model*.safetensors"))
        return out

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, CloverRMSNorm):
            init.zeros_(module.weight)
        elif isinstance(module, CloverGatedRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, CloverExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, CloverGatedDeltaNet):
            dt_bias, a_log = fresh_decay(module.v_heads)
            init.copy_(module.dt_bias, dt_bias)
            init.copy_(module.A_log, a_log)
            init.zeros_(module.right_conv)
            init.zeros_(module.block_calibration)
            init.constant_(module.bidir_log_scale, 0.5 * math.log(module.dk))


class CloverModel(CloverPreTrainedModel):
    def __init__(self, config: CloverConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CloverDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = CloverRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids, layout: Layout, cache: CloverCache | None = None, keep: int = 0):
        """Hidden states of every column, or with `keep` > 0 of the last `keep` only: the last layer
        then computes its attention queries, output projection and MLP for those columns alone (what
        llama.cpp does with its output ids): a prompt chunk's other columns only feed the cache."""
        x = self.embed_tokens(input_ids)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, layout, cache, keep if i == last else 0)
        return self.norm(x)


class CloverForBlockDiffusion(CloverPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    shift = True  # the model seam (engine/model_api.py): hidden state i predicts token i+1
    block_align = "relative"  # blocks start right after the prompt
    ragged_drafts = True  # rows of different draft widths share a forward (`draft_lens`, eager)

    def __init__(self, config: CloverConfig):
        super().__init__(config)
        self.model = CloverModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "quantization_config", None):  # an int4 checkpoint (`clover quantize`)
            apply_quantization(self, config.quantization_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    # ---- the stream forward in three parts (a compiled runner runs the middle one as one graph) ----
    def prepare_stream(self, input_ids, cache, block_size=None, draft_len=0, clean_block_size=None, pad_mask=None,
                       static: bool = False, draft_lens: list[int] | None = None) -> Layout:
        """Validate, make room in the cache and build the layout (host-side work, before the layers)."""
        clean_block_size, block = self.check_stream(input_ids, cache, block_size, draft_len, clean_block_size, static)
        batch, length = input_ids.shape
        if draft_lens is not None and (len(draft_lens) != batch or not 1 <= min(draft_lens) <= max(draft_lens)
                                       <= draft_len):
            raise ValueError(f"draft_lens={draft_lens}: one per row, each in [1, draft_len={draft_len}]")
        return stream_layout(self.config, batch, length, draft_len, clean_block_size, block, cache, pad_mask,
                             input_ids.device, static, draft_lens)

    def check_stream(self, input_ids, cache, block_size=None, draft_len=0, clean_block_size=None,
                     static: bool = False) -> tuple[int, int]:
        """Validate and make room in the cache; returns the (clean, draft) window sizes. The part of
        `prepare_stream` that must run on the host: a compiled runner builds the layout in its graph."""
        length = input_ids.shape[1]
        block = block_size or 1
        if draft_len and not 1 <= draft_len <= length:
            raise ValueError(f"draft_len={draft_len} must be in [1, {length}]")
        if cache is not None:
            cache.reserve(length)  # draft columns get scratch slots (static), every new column does (eager)
        return clean_block_size or (block if draft_len else 1), block

    def head(self, hidden, logits_to_keep: int = 0, logits_index=None):
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        if logits_index is not None:
            hidden = hidden[:, logits_index]
        return self.lm_head(hidden)

    @staticmethod
    def commit_lens(cache, num_clean: int, pad_mask=None) -> None:
        """After the layers wrote the clean columns: advance each row's committed length."""
        if cache is not None:
            cache.advance(num_clean - (pad_mask.sum(1) if pad_mask is not None else 0))

    def new_cache(self, batch_size: int, capacity: int = 256) -> CloverCache:
        return CloverCache(self.config, batch_size, capacity, device=self.device, dtype=self.dtype)

    def forward(
        self,
        input_ids: torch.LongTensor,
        cache: CloverCache | None = None,
        block_size: int | None = None,
        draft_len: int = 0,
        clean_block_size: int | None = None,
        pad_mask: torch.Tensor | None = None,
        noisy_input_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        logits_index: torch.LongTensor | None = None,
        draft_lens: list[int] | None = None,
        **unused,
    ) -> CloverOutput:
        """See the module docstring. Logits at column i predict the token after column i.

        `logits_to_keep` > 0 computes the head only for the last that many columns, `logits_index`
        only for those of them (a draft window's still-masked columns: the head is a large share of a
        step at a big vocabulary). `draft_lens`: rows of different draft widths in one forward (see
        `stream_layout`; the engine's slot jobs, `ragged_drafts`). In the training
        layout the logits returned are those of the noisy half. `labels` (AR mode) gives the mean
        next-token cross-entropy, labels shifted inside as in transformers.
        """
        batch, length = input_ids.shape
        device = input_ids.device
        if noisy_input_ids is not None:
            block = block_size or self.config.block_size
            layout = training_layout(self.config, batch, length, block, device)
            hidden = self.model(torch.cat([noisy_input_ids, input_ids], dim=1), layout)[:, :length]
        else:
            layout = self.prepare_stream(input_ids, cache, block_size, draft_len, clean_block_size, pad_mask,
                                         draft_lens=draft_lens)
            hidden = self.model(input_ids, layout, cache, logits_to_keep)
            self.commit_lens(cache, length - draft_len, pad_mask)
        logits = self.head(hidden, logits_to_keep, logits_index)
        loss = None
        if labels is not None:
            shifted = F.pad(labels[:, 1:], (0, 1), value=-100)  # no [:, :-1] slice of the logits (a copy)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(), ignore_index=-100)
        return CloverOutput(loss=loss, logits=logits)
