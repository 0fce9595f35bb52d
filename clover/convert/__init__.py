"""AR checkpoint (Qwen3-Next / Qwen3.5-MoE layouts) -> Clover."""

from .convert import ConversionError, convert_checkpoint
from .mapping import clover_config_from_hf, convert_state_dict

__all__ = ["ConversionError", "clover_config_from_hf", "convert_checkpoint", "convert_state_dict"]
