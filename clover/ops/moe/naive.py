"""Reference expert dispatch: every (token, chosen expert) pair on its own."""

import torch
import torch.nn.functional as F


def naive_experts(x, top_idx, top_w, gate_up, down):
    out = torch.zeros_like(x, dtype=torch.float32)
    inter = down.shape[-1]
    for t in range(x.shape[0]):
        for slot in range(top_idx.shape[1]):
            e = int(top_idx[t, slot])
            h = gate_up[e].float() @ x[t].float()
            y = down[e].float() @ (F.silu(h[:inter]) * h[inter:])
            out[t] += top_w[t, slot].float() * y
    return out.to(x.dtype)
