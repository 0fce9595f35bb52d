"""CloverConfig: the Qwen3.5-MoE / Qwen3-Next text backbone plus the block-diffusion fields.

Field names follow transformers' Qwen3.5-MoE text config so that converted checkpoints keep their
meaning; `rope_theta` and `partial_rotary_factor` are kept flat (and read from `rope_parameters`
when a source config nests them).
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from ..presets import (CALIBRATION_ANCHORS, LAYER_KINDS, PRESETS,  # noqa: F401  (torch-free home, re-exported)
                       default_layer_types, num_calibration_anchors)


class CloverConfig(PretrainedConfig):
    model_type = "clover"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size: int = 248320,
        hidden_size: int = 2048,
        num_hidden_layers: int = 40,
        layer_types: list[str] | None = None,
        full_attention_interval: int = 4,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 2,
        head_dim: int = 256,
        partial_rotary_factor: float = 0.25,
        rope_theta: float = 10_000_000.0,
        attention_bias: bool = False,
        linear_num_key_heads: int = 16,
        linear_num_value_heads: int = 32,
        linear_key_head_dim: int = 128,
        linear_value_head_dim: int = 128,
        linear_conv_kernel_dim: int = 4,
        num_experts: int = 256,
        num_experts_per_tok: int = 8,
        norm_topk_prob: bool = True,
        moe_intermediate_size: int = 512,
        shared_expert_intermediate_size: int = 512,
        hidden_act: str = "silu",
        max_position_embeddings: int = 131072,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        mask_token_id: int | None = None,
        block_size: int = 32,
        max_block_size: int = 64,
        router_aux_loss_coef: float = 0.001,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        **kwargs,
    ):
        rope = kwargs.pop("rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", rope_theta)
        partial_rotary_factor = rope.get("partial_rotary_factor", partial_rotary_factor)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        if layer_types is None:
            layer_types = default_layer_types(num_hidden_layers, full_attention_interval)
        self.layer_types = list(layer_types)
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.partial_rotary_factor = partial_rotary_factor
        self.rope_theta = rope_theta
        self.attention_bias = attention_bias
        self.linear_num_key_heads = linear_num_key_heads
        self.linear_num_value_heads = linear_num_value_heads
        self.linear_key_head_dim = linear_key_head_dim
        self.linear_value_head_dim = linear_value_head_dim
        self.linear_conv_kernel_dim = linear_conv_kernel_dim
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.mask_token_id = mask_token_id if mask_token_id is not None else vocab_size - 1
        self.block_size = block_size
        self.max_block_size = max_block_size
        self.router_aux_loss_coef = router_aux_loss_coef
        self.validate()  # before the base class, which has weaker checks of its own
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            **kwargs,
        )

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""

        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"CloverConfig.{field}: {why}")

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings", "max_block_size",
        ):
            value = getattr(self, name)
            need(isinstance(value, int) and value >= 1, name, f"must be a positive integer, got {value!r}")
        need(len(self.layer_types) == self.num_hidden_layers, "layer_types",
             f"has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        for kind in self.layer_types:
            need(kind in LAYER_KINDS, "layer_types", f"unknown layer kind {kind!r} (known: {', '.join(LAYER_KINDS)})")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_key_heads",
             f"{self.linear_num_key_heads} does not divide linear_num_value_heads={self.linear_num_value_heads}")
        rotary = self.head_dim * self.partial_rotary_factor
        need(0 < self.partial_rotary_factor <= 1 and rotary == int(rotary) and int(rotary) % 2 == 0,
             "partial_rotary_factor", f"head_dim*factor must be a positive even integer, got {rotary}")
        need(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
             f"{self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        need(isinstance(self.shared_expert_intermediate_size, int) and self.shared_expert_intermediate_size >= 0,
             "shared_expert_intermediate_size", "must be a non-negative integer")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        need(isinstance(self.block_size, int) and 1 <= self.block_size <= self.max_block_size, "block_size",
             f"must be an integer in [1, max_block_size={self.max_block_size}], got {self.block_size!r}")
        need(isinstance(self.mask_token_id, int) and 0 <= self.mask_token_id < self.vocab_size, "mask_token_id",
             f"{self.mask_token_id!r} is outside the vocabulary [0, {self.vocab_size})")
        need(self.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_calibration_anchors(self) -> int:
        return num_calibration_anchors(self.max_block_size)


def calibration_weights(block_size: int, num_anchors: int) -> list[float]:
    """Interpolation weights over the calibration anchors for one block size (all zero for size 1)."""
    weights = [0.0] * num_anchors
    if block_size <= 1:
        return weights
    pos = min(math.log2(block_size) - 1.0, num_anchors - 1.0)  # anchor i sits at block size 2**(i+1)
    lo = int(math.floor(pos))
    frac = pos - lo
    weights[lo] += 1.0 - frac
    if frac > 0:
        weights[lo + 1] += frac
    return weights


def preset_config(name: str, **overrides) -> CloverConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return CloverConfig(**{**PRESETS[name], **overrides})
