"""Chunked gated delta rule (WY form): parallel inside a chunk, one small recurrence across chunks.

Inside a chunk with start state S and cumulative log decay G_t = g_1 + ... + g_t:
    (I + A) D = beta*V - diag(beta e^G) K S,   A_ij = beta_i e^(G_i - G_j) k_i.k_j  (j < i)
    O = scale * [ (Q e^G) S + (Q K^T . e^(G_t - G_i), i <= t) D ]
    S' = e^(G_C) S + (K e^(G_C - G))^T D
Sequences are padded on the LEFT to a whole number of chunks, so chunk boundaries are anchored at
the end of the sequence: this is how block-diffusion windows are laid out (the first one may be
partial). Padding tokens have k = v = 0, g = 0, beta = 0 and leave the state untouched.
"""

from functools import lru_cache

import torch
import torch.nn.functional as F

from ..utils import cast


def _tri(chunk_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(strictly-upper mask, identity) of one chunk: built once, not twice per layer per decoding step.
    In a compiled graph they are built in the graph (constants inductor folds; dynamo would trace past
    the cache anyway, with a warning)."""
    if torch.compiler.is_compiling():
        return _make_tri(chunk_size, device)
    return _cached_tri(chunk_size, device)


def _make_tri(chunk_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).triu(1), torch.eye(chunk_size, device=device)


@lru_cache(maxsize=16)
def _cached_tri(chunk_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Built outside inference mode even when first asked for while decoding: an inference tensor could
    never be saved for backward by a later training step in the same process."""
    with torch.inference_mode(False):
        return _make_tri(chunk_size, device)


def _chunked(q, k, v, g, beta, scale, chunk_size, with_state: bool = True):
    """Per-chunk terms that do not depend on the start state. Returns tensors shaped [B, H, N, C, *].
    `with_state=False` skips the terms only the state carried out of a chunk needs."""
    length = q.shape[1]
    pad = (-length) % chunk_size
    q, k, v, g, beta = (cast(x, torch.float32) for x in (q, k, v, g, beta))
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, pad, 0)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, pad, 0)) for x in (g, beta))
    batch, total, heads, _ = q.shape
    n = total // chunk_size

    def split(x):  # [B, T, H, *] -> [B, H, N, C, *]
        x = x.transpose(1, 2)
        return x.reshape(batch, heads, n, chunk_size, *x.shape[3:])

    q, k, v, g, beta = split(q), split(k), split(v), split(g), split(beta)
    cum = g.cumsum(-1)  # [B, H, N, C]
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # G_t - G_i
    upper, eye = _tri(chunk_size, q.device)
    decay = diff.masked_fill(upper, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    system = (kk * decay * beta.unsqueeze(-1)).tril(-1) + eye
    cum_exp = cum.exp()
    rhs = torch.cat([v * beta.unsqueeze(-1), k * (beta * cum_exp).unsqueeze(-1)], dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    dv = v.shape[-1]
    out = dict(
        pad=pad,
        new_v=sol[..., :dv],  # T beta V
        k_cum=sol[..., dv:],  # T diag(beta e^G) K
        q_dec=q * (cum_exp * scale).unsqueeze(-1),
        intra=(q @ k.transpose(-1, -2)) * (decay * scale),
    )
    if with_state:
        out.update(k_tail=k * (cum[..., -1:] - cum).exp().unsqueeze(-1), chunk_decay=cum[..., -1].exp())
    return out


def _finish(out, pad, length, dtype):
    batch, heads, n, c, dv = out.shape
    out = out.reshape(batch, heads, n * c, dv)[:, :, pad:]
    return out.transpose(1, 2).to(dtype)


def chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state=None, chunk_size=64):
    """Returns (output [B, T, H, Dv], final state, state at the start of every chunk [B, H, N, Dk, Dv])."""
    length = q.shape[1]
    t = _chunked(q, k, v, g, beta, scale, chunk_size)
    batch, heads, n = t["new_v"].shape[:3]
    dk, dv = q.shape[-1], v.shape[-1]
    state = q.new_zeros(batch, heads, dk, dv, dtype=torch.float32) if initial_state is None else initial_state.float()
    outs, starts = [], []
    for i in range(n):
        starts.append(state)
        delta = t["new_v"][:, :, i] - t["k_cum"][:, :, i] @ state
        outs.append(t["q_dec"][:, :, i] @ state + t["intra"][:, :, i] @ delta)
        state = state * t["chunk_decay"][:, :, i, None, None] + t["k_tail"][:, :, i].transpose(-1, -2) @ delta
    out = _finish(torch.stack(outs, dim=2), t["pad"], length, q.dtype)
    return out, state, torch.stack(starts, dim=2)


def chunk_gated_delta_rule_from_states(q, k, v, g, beta, scale, chunk_states, chunk_size):
    """Every chunk starts from its own given state (no carry between chunks): the noisy half of the
    block-diffusion training layout, where noisy window i starts from the clean state before it."""
    length = q.shape[1]
    t = _chunked(q, k, v, g, beta, scale, chunk_size, with_state=False)
    delta = t["new_v"] - t["k_cum"] @ chunk_states
    out = t["q_dec"] @ chunk_states + t["intra"] @ delta
    return _finish(out, t["pad"], length, q.dtype)
