"""Reference masked attention: one query at a time over the keys its mask allows."""

import torch


def naive_masked_attention(q, k, v, mask, scale):
    """q [B, Hq, Lq, D]; k, v [B, Hkv, Lk, D*]; mask bool [B, 1 or Hq, Lq, Lk] (True = may attend)."""
    batch, hq, lq, _ = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(batch, hq, lq, v.shape[-1], dtype=torch.float32)
    for b in range(batch):
        for h in range(hq):
            m = mask[b, h if mask.shape[1] > 1 else 0]
            for i in range(lq):
                allowed = m[i].nonzero().flatten()
                scores = torch.stack([(q[b, h, i].float() @ k[b, h // group, j].float()) * scale for j in allowed])
                weights = torch.softmax(scores, dim=0)
                out[b, h, i] = sum(w * v[b, h // group, j].float() for w, j in zip(weights, allowed))
    return out.to(q.dtype)
