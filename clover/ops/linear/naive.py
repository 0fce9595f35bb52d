"""The reference: y = x @ W^T + b, as nn.Linear computes it."""

import torch.nn.functional as F


def naive_linear(x, weight, bias=None):
    return F.linear(x, weight, bias)
