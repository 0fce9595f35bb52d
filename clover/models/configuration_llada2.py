"""LLaDA2.0 / LLaDA2.1 (inclusionAI, `LLaDA2MoeModelLM`) config: the Ling 2.0 / BailingMoeV2 layout
(fused QKV, QK-norm, partial RoPE, sigmoid router with expert bias and group-limited top-k, shared
experts, the first `first_k_dense_replace` layers dense). Defaults of the published
configuration_llada2_moe.py."""

from __future__ import annotations

from .configuration_family import FamilyConfig, expert_shapes, swiglu_shapes


class LLaDA2MoeConfig(FamilyConfig):
    model_type = "llada2_moe"
    architectures = ("LLaDA2MoeModelLM",)
    DEFAULTS = dict(
        vocab_size=30592, hidden_size=1024, intermediate_size=None, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=0, hidden_act="silu", use_qkv_bias=False, use_qk_norm=True, use_bias=True,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=16384, rope_theta=10000.0,
        num_experts=16, num_shared_experts=0, num_experts_per_tok=2, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, moe_intermediate_size=None, first_k_dense_replace=0, head_dim=None,
        partial_rotary_factor=0.5, pad_token_id=126081, eos_token_id=None, torch_dtype=None, mask_token_id=None,
        block_size=None,
    )

    def finish(self) -> None:
        super().finish()
        if not self.num_key_value_heads:
            raise ValueError("num_key_value_heads must be > 0")
        if self.raw.get("score_function", "sigmoid") != "sigmoid":
            raise ValueError(f"score_function {self.raw.get('score_function')!r} is not supported (only sigmoid)")

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts is not None and i >= self.first_k_dense_replace

    def routed_expert_count(self) -> tuple[int, int]:
        return self.num_experts or 0, self.num_experts_per_tok

    def param_shapes(self) -> dict:
        h, d = self.hidden_size, self.head_dim
        qkv = (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        out = {"model.word_embeddings.weight": (self.vocab_size, h)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            out[p + "attention.query_key_value.weight"] = (qkv, h)
            if self.use_qkv_bias:
                out[p + "attention.query_key_value.bias"] = (qkv,)
            if self.use_qk_norm:
                out[p + "attention.query_layernorm.weight"] = out[p + "attention.key_layernorm.weight"] = (d,)
            out[p + "attention.dense.weight"] = (h, self.num_attention_heads * d)
            if self.use_bias:
                out[p + "attention.dense.bias"] = (h,)
            m = p + "mlp."
            if self.is_moe_layer(i):
                out[m + "gate.weight"] = (self.num_experts, h)
                out[m + "gate.expert_bias"] = (self.num_experts,)
                out.update(expert_shapes(m, self.num_experts, h, self.moe_intermediate_size))
                if self.num_shared_experts:
                    out.update(swiglu_shapes(m + "shared_experts.", h, self.moe_intermediate_size * self.num_shared_experts))
            else:
                out.update(swiglu_shapes(m, h, self.intermediate_size))
            out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = (h,)
        out["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, h)
        return out
