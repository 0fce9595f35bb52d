"""fp32 linear through oneDNN with the weight prepacked into its blocked layout (CPU).

On x86 CPUs torch's fp32 `F.linear` calls MKL, which repacks the weight on every call and, on AMD
CPUs, runs its AVX2 kernels: at 8-32 rows a draft window's projections and LM head run at 30-80
GFLOP/s. oneDNN's AVX-512 kernels on a weight packed once run them 1.6-2.6x faster
(bench/linear.py), but pay ~10 us a call, so a single row (an AR step) and small weights stay on
MKL (`worth_packing`). The compiled CPU runner routes the linears of its graphs here
(engine/runner.route_linears); eager never does.

The packed copy is cached per weight tensor (by identity, dropped with it) and rebuilt whenever the
weight's version counter moves (an in-place update: `copy_`, `load_state_dict`, an optimizer step),
so it can never serve stale weights. It costs one extra copy of each packed weight's bytes. A weight
made under `torch.inference_mode` has no version counter: it runs unpacked (F.linear).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

MIN_ROWS = 8  # rows per call from which oneDNN's fixed cost pays (bench/linear.py)
MIN_MACS = 1_500_000  # multiply-adds per call from which it pays the ~10 us of the op's own call

_packed = WeakIdKeyDictionary()  # weight -> (its _version when packed, the packed tensor)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def worth_packing(rows: int, weight: torch.Tensor) -> bool:
    return (available() and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and rows >= MIN_ROWS and rows * weight.numel() >= MIN_MACS)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    entry = _packed.get(weight)
    if entry is None or entry[0] != weight._version:
        with torch.no_grad():
            entry = _packed[weight] = (weight._version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
    return entry[1]


@torch.library.custom_op("clover::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for fp32 CPU tensors, computed by oneDNN on the packed weight."""
    if weight.is_inference():  # no version counter: an in-place update could not be seen, so no packed copy
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), packed_weight(weight), bias,
                                             "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


@packed_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
