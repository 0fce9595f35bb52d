"""Token-by-token gated delta rule vectorised over batch and heads: the decode-step form."""

import torch

from ..utils import cast


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state=None):
    batch, length, heads, dk = k.shape
    out_dtype = q.dtype
    if initial_state is None:
        state = q.new_zeros(batch, heads, dk, v.shape[-1], dtype=torch.float32)
    else:
        state = cast(initial_state, torch.float32)
    q, k, v, g, beta = (cast(x, torch.float32) for x in (q, k, v, g, beta))
    decay = g.exp()
    outs = []
    for t in range(length):
        kt = k[:, t].unsqueeze(-1)  # [B, H, Dk, 1]
        state = state * decay[:, t, :, None, None]
        error = v[:, t] - (state * kt).sum(-2)  # [B, H, Dv]
        state = state + kt * (error * beta[:, t, :, None]).unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(-2) * scale)
    out = outs[0].unsqueeze(1) if length == 1 else torch.stack(outs, dim=1)
    return cast(out, out_dtype), state
