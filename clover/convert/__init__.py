"""AR checkpoint (Qwen3-Next / Qwen3.5-MoE layouts) -> Clover."""

from .mapping import clover_config_from_hf, convert_state_dict

__all__ = ["clover_config_from_hf", "convert_state_dict"]
