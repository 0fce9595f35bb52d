"""Block short convolution as K shifted multiply-adds for the causal part and K-1 masked ones for
the right branch. With K = 4 this beats torch's depthwise conv1d by 2-50x on CPU for decode-sized
inputs (mkldnn's depthwise path has a large fixed cost) and is no slower for long sequences."""

import torch.nn.functional as F

from ..utils import cast


def block_short_conv(x_ext, weight, right_weight, window_ids):
    kernel = weight.shape[-1]
    length = x_ext.shape[-1] - (kernel - 1)
    weight = cast(weight, x_ext.dtype)
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
