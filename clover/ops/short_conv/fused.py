"""Block short convolution: the causal part as K shifted multiply-adds for short inputs (decode
steps, draft windows: torch's depthwise conv1d has a large fixed cost on CPU) and as that conv1d
for long ones (prefill, training); the right branch as K-1 masked multiply-adds."""

import torch.nn.functional as F

from ..utils import cast

LONG = 128  # columns from which torch's depthwise conv1d is the faster causal part


def block_short_conv(x_ext, weight, right_weight, window_ids):
    kernel = weight.shape[-1]
    length = x_ext.shape[-1] - (kernel - 1)
    weight = cast(weight, x_ext.dtype)
    if length >= LONG:
        out = F.conv1d(x_ext, weight[:, None, :], groups=weight.shape[0])
    else:
        out = weight[:, :1] * x_ext[..., :length]
        for j in range(1, kernel):
            out = out + weight[:, j : j + 1] * x_ext[..., j : j + length]
    if right_weight is None:
        return out
    x = x_ext[..., kernel - 1 :]
    right_weight = cast(right_weight, x.dtype)
    for j in range(1, min(kernel, length)):
        same = (window_ids[j:] == window_ids[:-j]).to(x.dtype)  # [L - j]
        shifted = right_weight[:, j - 1 : j] * x[..., j:] * same
        out = out + F.pad(shifted, (0, j))
    return out
