"""Clover: block-diffusion language models on a hybrid Gated-DeltaNet / gated-attention MoE backbone."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .models import CloverCache, CloverConfig, CloverForBlockDiffusion, CloverModel, preset_config

__version__ = "0.1.0"

AutoConfig.register("clover", CloverConfig, exist_ok=True)
AutoModel.register(CloverConfig, CloverModel, exist_ok=True)
AutoModelForCausalLM.register(CloverConfig, CloverForBlockDiffusion, exist_ok=True)

__all__ = ["CloverCache", "CloverConfig", "CloverForBlockDiffusion", "CloverModel", "preset_config"]

from .api import Generation, generate, load  # noqa: E402

__all__ += ["Generation", "generate", "load"]

from .decide import decide  # noqa: E402

__all__ += ["decide"]

from .structured import generate_json  # noqa: E402

__all__ += ["generate_json"]
