"""SDAR (JetAstra/SDAR) configs: `SDARForCausalLM` has the Qwen3 layout, `SDARMoeForCausalLM` the
Qwen3-MoE layout; the defaults are those of the published configuration_sdar(_moe).py (Qwen3's)."""

from __future__ import annotations

from .configuration_family import FamilyConfig, expert_shapes, qwen_layout_shapes, swiglu_shapes

_QWEN3 = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, head_dim=None, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    tie_word_embeddings=False, rope_theta=10000.0, attention_bias=False, pad_token_id=None, eos_token_id=None,
    bos_token_id=None, torch_dtype=None, block_size=None, mask_token_id=None,
)


class SDARConfig(FamilyConfig):
    model_type = "sdar"
    architectures = ("SDARForCausalLM",)
    DEFAULTS = dict(_QWEN3)

    def param_shapes(self) -> dict:
        return qwen_layout_shapes(self, self.attention_bias, self.attention_bias, True,
                                  lambda i, p: swiglu_shapes(p, self.hidden_size, self.intermediate_size))


class SDARMoeConfig(FamilyConfig):
    model_type = "sdar_moe"
    architectures = ("SDARMoeForCausalLM",)
    DEFAULTS = dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_key_value_heads=4,
                    decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
                    norm_topk_prob=False, mlp_only_layers=())

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    def routed_expert_count(self) -> tuple[int, int]:
        return self.num_experts, self.num_experts_per_tok

    def param_shapes(self) -> dict:
        def mlp(i, p):
            if not self.is_moe_layer(i):
                return swiglu_shapes(p, self.hidden_size, self.intermediate_size)
            return {p + "gate.weight": (self.num_experts, self.hidden_size),
                    **expert_shapes(p, self.num_experts, self.hidden_size, self.moe_intermediate_size)}
        return qwen_layout_shapes(self, self.attention_bias, self.attention_bias, True, mlp)
