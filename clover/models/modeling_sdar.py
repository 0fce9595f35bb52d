"""SDAR (JetAstra/SDAR): `SDARForCausalLM` (Qwen3 layout) and `SDARMoeForCausalLM` (Qwen3-MoE
layout), block-causal. No token shift: the logits at a masked position predict that position.
Blocks sit at absolute positions k*B from the first prompt token (block 4 by default), mask token
`<|MASK|>` (151669). The layers read the published names; shared parts: modeling_family.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_sdar import SDARConfig, SDARMoeConfig
from .modeling_family import BlockFamilyModel, DecoderLayer, Experts, RMSNorm, SwiGLU, attend, take_columns


class QwenAttention(nn.Module):
    """Separate q/k/v/o projections (`qkv_bias`, `o_bias`), optional per-head QK RMSNorm (Qwen3)."""

    def __init__(self, c, layer: int, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer, self.theta, self.rotary_dim = layer, c.rope_theta, c.rotary_dim
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h, q, kv = c.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, q, bias=qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.qk_norm = qk_norm

    def forward(self, x, step):
        b, n, _ = x.shape
        xq = x if step.select is None else take_columns(x, step.select, 1)  # queries of the selected columns only
        q = self.q_proj(xq).view(b, xq.shape[1], self.heads, self.head_dim)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), step, self.layer,
                     self.rotary_dim, self.theta)
        return self.o_proj(out)


class Qwen3MoeBlock(nn.Module):
    """Softmax router, top-k experts (weights renormalised when `norm_topk_prob`), no shared expert."""

    def __init__(self, c):
        super().__init__()
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        top_w, top_idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        return self.experts(flat, top_idx, top_w.to(x.dtype)).view_as(x)


class SDARForCausalLM(BlockFamilyModel):
    config_class = SDARConfig
    family = "sdar"
    shift = False
    block_align = "absolute"
    mask_token = "<|MASK|>"
    mask_token_id = 151669
    default_block_size = 4
    default_threshold = 0.85  # generate.py's confidence_threshold
    modes = ("low_confidence",)
    published_decoding = ("low_confidence_dynamic", "low_confidence_static", "sequential")

    def build_layer(self, i: int) -> nn.Module:
        c = self.config
        attn = QwenAttention(c, i, c.attention_bias, c.attention_bias, qk_norm=True)
        return DecoderLayer("self_attn", attn, self.build_mlp(i), c.hidden_size, c.rms_norm_eps)

    def build_mlp(self, i: int) -> nn.Module:
        return SwiGLU(self.config.hidden_size, self.config.intermediate_size)


class SDARMoeForCausalLM(SDARForCausalLM):
    config_class = SDARMoeConfig
    family = "sdar_moe"

    def build_mlp(self, i: int) -> nn.Module:
        return Qwen3MoeBlock(self.config) if self.config.is_moe_layer(i) else super().build_mlp(i)
