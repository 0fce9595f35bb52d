"""Reference block short convolution: one output column and one tap at a time."""

import torch


def naive_block_short_conv(x_ext, weight, right_weight, window_ids):
    """x_ext [B, C, K-1+L]; weight [C, K]; right_weight [C, K-1]; window_ids [L]. Returns [B, C, L]."""
    kernel = weight.shape[-1]
    length = x_ext.shape[-1] - (kernel - 1)
    out = torch.zeros(x_ext.shape[0], x_ext.shape[1], length, dtype=torch.float32)
    for t in range(length):
        for j in range(kernel):  # tap j multiplies input t - (K-1-j)
            out[:, :, t] += weight[:, j].float() * x_ext[:, :, t + j].float()
        for j in range(1, kernel):
            if t + j < length and window_ids[t + j] == window_ids[t]:
                out[:, :, t] += right_weight[:, j - 1].float() * x_ext[:, :, kernel - 1 + t + j].float()
    return out.to(x_ext.dtype)
