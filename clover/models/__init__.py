from .cache_clover import CloverCache
from .configuration_clover import PRESETS, CloverConfig, preset_config
from . import families  # noqa: F401 - bound here also when utils.checkpoint.families_module loaded it first
from .families import FAMILIES, family_of, load_family
from .modeling_clover import CloverForBlockDiffusion, CloverModel, CloverPreTrainedModel

__all__ = [
    "PRESETS",
    "CloverCache",
    "CloverConfig",
    "CloverForBlockDiffusion",
    "CloverModel",
    "CloverPreTrainedModel",
    "FAMILIES",
    "family_of",
    "load_family",
    "preset_config",
]


def _register_auto_classes() -> None:
    """AutoConfig / AutoModel / AutoModelForCausalLM know `model_type: clover` once clover.models is imported."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    AutoConfig.register("clover", CloverConfig, exist_ok=True)
    AutoModel.register(CloverConfig, CloverModel, exist_ok=True)
    AutoModelForCausalLM.register(CloverConfig, CloverForBlockDiffusion, exist_ok=True)


_register_auto_classes()
