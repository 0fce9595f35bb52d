"""Fast-dLLM v2 (NVlabs/Fast-dLLM v2/, `Fast_dLLM_QwenForCausalLM`): the Qwen2.5 layout (q/k/v
biases, no QK-norm), block-causal, WITH token shift (the logits at position i predict token i+1,
as in Clover). Blocks of `bd_size` (32) at absolute positions, decoded in sub-blocks of 8 with
threshold 0.9; mask token `|<MASK>|` (151665). Shared parts: modeling_family.py."""

from __future__ import annotations

from torch import nn

from .configuration_fast_dllm import FastDLLMConfig
from .modeling_family import BlockFamilyModel, DecoderLayer, SwiGLU
from .modeling_sdar import QwenAttention


class FastDLLMForCausalLM(BlockFamilyModel):
    config_class = FastDLLMConfig
    family = "fast_dllm_v2"
    shift = True
    block_align = "absolute"
    mask_token = "|<MASK>|"
    mask_token_id = 151665
    default_block_size = 32
    default_sub_block_size = 8
    default_threshold = 0.9
    modes = ("low_confidence", "ar", "self_spec")  # with shift, block size 1 is its AR model
    published_decoding = ("sub_block_threshold",)

    @property
    def block_size(self) -> int:
        return self.config.bd_size or self.default_block_size

    def build_layer(self, i: int) -> nn.Module:
        c = self.config
        attn = QwenAttention(c, i, qkv_bias=True, o_bias=False, qk_norm=False)
        return DecoderLayer("self_attn", attn, SwiGLU(c.hidden_size, c.intermediate_size), c.hidden_size,
                            c.rms_norm_eps)
