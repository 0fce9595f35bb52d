"""Reference gated delta rule: one token, one head at a time. Slow on purpose; it is the spec."""

import torch


def naive_gated_delta_rule(q, k, v, g, beta, scale, initial_state=None):
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    out = torch.zeros(batch, length, heads, dv, dtype=torch.float32, device=q.device)
    state = torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        state = initial_state.float().clone()
    for b in range(batch):
        for h in range(heads):
            s = state[b, h]
            for t in range(length):
                kt, vt, qt = k[b, t, h].float(), v[b, t, h].float(), q[b, t, h].float()
                s = s * torch.exp(g[b, t, h].float())
                error = vt - s.t() @ kt
                s = s + torch.outer(kt, beta[b, t, h].float() * error)
                out[b, t, h] = scale * (s.t() @ qt)
            state[b, h] = s
    return out.to(q.dtype), state
