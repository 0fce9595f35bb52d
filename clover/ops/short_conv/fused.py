"""Block short convolution with one grouped conv1d for the causal part and K-1 masked shifts for
the right branch (K is 4: three fused multiply-adds, cheaper than a second conv plus masking)."""

import torch
import torch.nn.functional as F


def block_short_conv(x_ext, weight, right_weight, window_ids):
    kernel = weight.shape[-1]
    length = x_ext.shape[-1] - (kernel - 1)
    out = F.conv1d(x_ext, weight.unsqueeze(1).to(x_ext.dtype), groups=x_ext.shape[1])
    if right_weight is None:
        return out
    x = x_ext[..., kernel - 1 :]
    for j in range(1, min(kernel, length)):
        same = (window_ids[j:] == window_ids[:-j]).to(x.dtype)  # [L - j]
        out[..., : length - j] += right_weight[:, j - 1 : j].to(x.dtype) * x[..., j:] * same
    return out
