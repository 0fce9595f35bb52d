"""Training: the `ar` and `block_diffusion` objectives and the `clover train` loop.

The names below are imported on first use (PEP 562), so `clover.training.config` (TrainConfig,
torch-free) loads without the loop and the objectives, which import torch.
"""

from importlib import import_module

_LAZY = {"TrainConfig": "config", "Trainer": "trainer", "lr_factor": "trainer", "ar_loss": "objectives",
         "block_diffusion_loss": "objectives", "block_diffusion_loss_naive": "objectives", "sample_noise": "objectives"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
