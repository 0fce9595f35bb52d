"""Tiny helpers for dispatch-bound code paths (a CPU decode step runs many small ops)."""

import torch


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, skipping the (no-op but not free) dispatch when it already is."""
    return x if x.dtype == dtype else x.to(dtype)
