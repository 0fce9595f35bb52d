"""Fast-dLLM v2 (NVlabs/Fast-dLLM v2/, `Fast_dLLM_QwenForCausalLM`) config: the Qwen2.5 layout
(q/k/v biases, no QK-norm) plus `bd_size`, the block size it was trained at."""

from __future__ import annotations

from .configuration_family import FamilyConfig, qwen_layout_shapes, swiglu_shapes


class FastDLLMConfig(FamilyConfig):
    model_type = "Fast_dLLM_Qwen"
    architectures = ("Fast_dLLM_QwenForCausalLM",)
    DEFAULTS = dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=None, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_theta=10000.0, bd_size=32, pad_token_id=None, eos_token_id=None,
        bos_token_id=None, torch_dtype=None, mask_token_id=None,
    )

    def param_shapes(self) -> dict:
        return qwen_layout_shapes(self, True, False, False,
                                  lambda i, p: swiglu_shapes(p, self.hidden_size, self.intermediate_size))
