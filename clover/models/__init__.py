from .cache_clover import CloverCache
from .configuration_clover import PRESETS, CloverConfig, preset_config
from .modeling_clover import CloverForBlockDiffusion, CloverModel, CloverPreTrainedModel

__all__ = [
    "PRESETS",
    "CloverCache",
    "CloverConfig",
    "CloverForBlockDiffusion",
    "CloverModel",
    "CloverPreTrainedModel",
    "preset_config",
]
