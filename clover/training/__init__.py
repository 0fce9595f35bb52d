"""Training: the `ar` and `block_diffusion` objectives and the `clover train` loop."""

from .objectives import ar_loss, block_diffusion_loss, block_diffusion_loss_naive, sample_noise
from .trainer import TrainConfig, Trainer, lr_factor

__all__ = ["TrainConfig", "Trainer", "ar_loss", "block_diffusion_loss", "block_diffusion_loss_naive",
           "lr_factor", "sample_noise"]
