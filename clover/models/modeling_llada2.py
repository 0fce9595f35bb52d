"""LLaDA2.0 / LLaDA2.1 (inclusionAI, `LLaDA2MoeModelLM`): the Ling 2.0 / BailingMoeV2 layout, fused
QKV with per-head QK RMSNorm, partial RoPE, a sigmoid router with expert bias and group-limited
top-k, shared experts, the first `first_k_dense_replace` layers dense. No token shift, block 32 at
absolute positions, mask token `<|mask|>` (156895). Shared parts: modeling_family.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_llada2 import LLaDA2MoeConfig
from .modeling_family import BlockFamilyModel, DecoderLayer, Experts, RMSNorm, SwiGLU, attend


class LingAttention(nn.Module):
    def __init__(self, c, layer: int):
        super().__init__()
        self.layer, self.theta, self.rotary_dim = layer, c.rope_theta, c.rotary_dim
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.query_key_value = nn.Linear(c.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim,
                                         bias=c.use_qkv_bias)
        self.use_qk_norm = c.use_qk_norm
        if c.use_qk_norm:
            self.query_layernorm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.dense = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.use_bias)

    def forward(self, x, step):
        b, n, _ = x.shape
        qkv = self.query_key_value(x).view(b, n, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), step, self.layer,
                     self.rotary_dim, self.theta)
        return self.dense(out)


class LingGate(nn.Module):
    """Sigmoid scores; experts chosen on score + expert_bias within the `topk_group` best groups
    (a group scored by its two best experts); weights = the chosen sigmoid scores renormalised
    (top-k > 1) and scaled by `routed_scaling_factor`."""

    def __init__(self, c):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.scale = c.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(c.num_experts))

    def forward(self, x):
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        routing = scores + self.expert_bias.float()
        t, e = routing.shape
        groups = routing.view(t, self.n_group, -1).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(self.topk_group, dim=-1).indices, 1.0)
        keep = keep[:, :, None].expand(-1, -1, e // self.n_group).reshape(t, e).bool()
        top_idx = routing.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices
        top_w = scores.gather(1, top_idx)
        if self.top_k > 1:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return top_idx, top_w * self.scale


class LingMoeBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate = LingGate(c)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        if c.num_shared_experts:
            self.shared_experts = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.num_shared_experts)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        top_idx, top_w = self.gate(flat)
        y = self.experts(flat, top_idx, top_w.to(x.dtype)).view_as(x)
        return y + self.shared_experts(x) if hasattr(self, "shared_experts") else y


class LLaDA2MoeModelLM(BlockFamilyModel):
    config_class = LLaDA2MoeConfig
    family = "llada2"
    shift = False
    block_align = "absolute"
    mask_token = "<|mask|>"
    mask_token_id = 156895
    default_block_size = 32
    default_threshold = 0.95
    modes = ("low_confidence", "edit")  # edit: LLaDA2.1's token-to-token editing
    published_decoding = ("threshold", "edit")
    embed_name = "word_embeddings"

    def build_layer(self, i: int) -> nn.Module:
        c = self.config
        mlp = LingMoeBlock(c) if c.is_moe_layer(i) else SwiGLU(c.hidden_size, c.intermediate_size)
        return DecoderLayer("attention", LingAttention(c, i), mlp, c.hidden_size, c.rms_norm_eps)
