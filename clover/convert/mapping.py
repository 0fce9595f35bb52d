"""Tensor-name and layout mapping from transformers' Qwen3-Next / Qwen3.5-MoE text models to Clover.

Works on one layer's worth of tensors at a time so a converter can stream shard by shard. Input
names are those of the transformers text model (`model.layers.{i}...`, `lm_head.weight`); on-disk
names with the multimodal `model.language_model.` prefix are brought to that form by `text_name`.
Experts may come fused (`experts.gate_up_proj` [E, 2I, H]) or per expert (`experts.{e}.gate_proj`,
what transformers' save_pretrained writes).
"""

from __future__ import annotations

import math
import re

import torch

from ..models.configuration_clover import CloverConfig

CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
    "num_key_value_heads", "head_dim", "attention_bias", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
    "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size", "shared_expert_intermediate_size",
    "hidden_act", "max_position_embeddings", "rms_norm_eps", "initializer_range", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
)


def clover_config_from_hf(hf: dict, **overrides) -> CloverConfig:
    """Build a CloverConfig from a Qwen3-Next / Qwen3.5-MoE config dict (text part)."""
    hf = hf.get("text_config", hf)
    kwargs = {k: hf[k] for k in CONFIG_FIELDS if k in hf and hf[k] is not None}
    rope = hf.get("rope_parameters") or {}
    kwargs["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    kwargs["partial_rotary_factor"] = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("dense (non-MoE) layers are not supported: mlp_only_layers / decoder_sparse_step")
    kwargs.update(overrides)
    return CloverConfig(**kwargs)


LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
MULTIMODAL_PREFIX = "model.language_model."


def text_prefix(keys) -> str:
    """The prefix of the text model's tensors on disk: multimodal checkpoints nest it one level down."""
    return MULTIMODAL_PREFIX if any(k.startswith(MULTIMODAL_PREFIX) for k in keys) else "model."


def text_name(key: str, prefix: str) -> str | None:
    """On-disk name -> text-model name, or None for tensors of other towers (vision, MTP head)."""
    if key == "lm_head.weight":
        return key
    if key.startswith(prefix):
        return "model." + key[len(prefix):]
    return None


def disk_name(name: str, prefix: str) -> str:
    """Inverse of `text_name`, so errors name the tensor as it is stored."""
    return prefix + name[len("model."):] if name.startswith("model.") else name


def skipped_group(key: str) -> str:
    """A short label for a skipped tensor's tower (`model.visual`, `mtp`)."""
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] == "model" else parts[0]


def layer_of(name: str) -> int | None:
    m = LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def diffusion_additions(cfg: CloverConfig, i: int) -> dict:
    """Identity values of a GDN layer's block-diffusion parameters (as CloverGatedDeltaNet initialises
    them), written explicitly so a converted checkpoint is complete."""
    if cfg.layer_types[i] != "linear_attention":
        return {}
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    conv_dim = 2 * hk * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim
    p = f"model.layers.{i}.linear_attn."
    return {
        p + "right_conv": torch.zeros(conv_dim, cfg.linear_conv_kernel_dim - 1),
        p + "block_calibration": torch.zeros(cfg.num_calibration_anchors, hv),
        p + "bidir_log_scale": torch.full((hv,), 0.5 * math.log(cfg.linear_key_head_dim)),
    }


class SourceShapeError(ValueError):
    """A source tensor whose shape does not follow from the config (`name` is its text-model name)."""

    def __init__(self, name: str, shape: tuple, want: tuple):
        super().__init__(self.describe(name, shape, want))
        self.name, self.shape, self.want = name, shape, want

    @staticmethod
    def describe(name: str, shape: tuple, want: tuple) -> str:
        return f"wrong shape for {name}: {shape}, the config implies {want}"


def _take(t: dict, name: str, *want: int) -> torch.Tensor:
    """Pop a tensor that is reshaped or concatenated, checking its shape first so a bad checkpoint
    fails with its name rather than a torch error (1:1 tensors are checked on the Clover side)."""
    x = t.pop(name)
    if tuple(x.shape) != want:
        raise SourceShapeError(name, tuple(x.shape), want)
    return x


def _experts(t: dict, cfg: CloverConfig, m: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused gate_up [E, 2I, H] and down [E, H, I], from fused or per-expert source tensors."""
    if m + "experts.gate_up_proj" in t:
        return t.pop(m + "experts.gate_up_proj"), t.pop(m + "experts.down_proj")
    e, h, i = m + "experts.", cfg.hidden_size, cfg.moe_intermediate_size
    gate_up = torch.stack([
        torch.cat([_take(t, f"{e}{j}.gate_proj.weight", i, h), _take(t, f"{e}{j}.up_proj.weight", i, h)])
        for j in range(cfg.num_experts)
    ])
    return gate_up, torch.stack([_take(t, f"{e}{j}.down_proj.weight", h, i) for j in range(cfg.num_experts)])


def qwen3next_twin(cfg: CloverConfig):
    """transformers' Qwen3NextForCausalLM with the same dims as a CloverConfig (random weights):
    the AR reference that benchmarks compare against."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
              "num_key_value_heads", "head_dim", "partial_rotary_factor", "rope_theta", "linear_num_key_heads",
              "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
              "num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size",
              "shared_expert_intermediate_size", "max_position_embeddings", "rms_norm_eps")
    return Qwen3NextForCausalLM(Qwen3NextConfig(**{f: getattr(cfg, f) for f in fields}))


def _gdn_in_proj(t: dict, cfg: CloverConfig, prefix: str) -> torch.Tensor:
    """Rows [q ; k ; v ; z ; b ; a], each contiguous over heads (the Qwen3.5 order)."""
    nk, dk, dv, hv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    rep, hidden = hv // nk, cfg.hidden_size
    if prefix + "in_proj_qkvz.weight" in t:  # Qwen3-Next: rows grouped per key head
        qkvz = _take(t, prefix + "in_proj_qkvz.weight", nk * (2 * dk + 2 * rep * dv), hidden)
        q, k, v, z = qkvz.view(nk, 2 * dk + 2 * rep * dv, hidden).split([dk, dk, rep * dv, rep * dv], dim=1)
        ba = _take(t, prefix + "in_proj_ba.weight", 2 * hv, hidden)
        b, a = ba.view(nk, 2 * rep, hidden).split([rep, rep], dim=1)
        parts = [x.reshape(-1, hidden) for x in (q, k, v, z, b, a)]
    else:  # Qwen3.5: already contiguous
        rows = {"qkv": 2 * nk * dk + hv * dv, "z": hv * dv, "b": hv, "a": hv}
        parts = [_take(t, prefix + f"in_proj_{n}.weight", r, hidden) for n, r in rows.items()]
    return torch.cat(parts)


def convert_layer(t: dict, cfg: CloverConfig, i: int) -> dict:
    """Pop layer i's source tensors from `t` and return Clover's backbone tensors. A missing source
    tensor raises KeyError naming it, a mis-shaped one SourceShapeError; the diffusion additions
    come from `diffusion_additions`."""
    src, dst = f"model.layers.{i}.", f"model.layers.{i}."
    out = {}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[dst + norm + ".weight"] = t.pop(src + norm + ".weight")
    if cfg.layer_types[i] == "full_attention":
        a = src + "self_attn."
        hidden, kv_rows = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
        q = _take(t, a + "q_proj.weight", 2 * cfg.num_attention_heads * cfg.head_dim, hidden)
        q, gate = q.view(cfg.num_attention_heads, 2, cfg.head_dim, hidden).unbind(1)
        k, v = _take(t, a + "k_proj.weight", kv_rows, hidden), _take(t, a + "v_proj.weight", kv_rows, hidden)
        out[dst + "self_attn.qkv_proj.weight"] = torch.cat([q.reshape(-1, hidden), gate.reshape(-1, hidden), k, v])
        for name in ("o_proj.weight", "q_norm.weight", "k_norm.weight"):
            out[dst + "self_attn." + name] = t.pop(a + name)
        if cfg.attention_bias:
            raise ValueError("attention_bias=True checkpoints are not supported")
    else:
        g = src + "linear_attn."
        out[dst + "linear_attn.in_proj.weight"] = _gdn_in_proj(t, cfg, g)
        for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"):
            out[dst + "linear_attn." + name] = t.pop(g + name)
    m = src + "mlp."
    out[dst + "mlp.gate.weight"] = t.pop(m + "gate.weight")
    out[dst + "mlp.experts.gate_up_proj"], out[dst + "mlp.experts.down_proj"] = _experts(t, cfg, m)
    if cfg.shared_expert_intermediate_size:
        si, h = cfg.shared_expert_intermediate_size, cfg.hidden_size
        out[dst + "mlp.shared_expert.gate_up_proj.weight"] = torch.cat(
            [_take(t, m + "shared_expert.gate_proj.weight", si, h), _take(t, m + "shared_expert.up_proj.weight", si, h)]
        )
        out[dst + "mlp.shared_expert.down_proj.weight"] = t.pop(m + "shared_expert.down_proj.weight")
        out[dst + "mlp.shared_expert_gate.weight"] = t.pop(m + "shared_expert_gate.weight")
    return out


def convert_state_dict(sd: dict, cfg: CloverConfig) -> dict:
    """Whole-model mapping (in-memory transformers names). Diffusion additions are left to the
    model's own identity initialisation."""
    t = dict(sd)
    out = {}
    for i in range(cfg.num_hidden_layers):
        out.update(convert_layer(t, cfg, i))
    out["model.embed_tokens.weight"] = t.pop("model.embed_tokens.weight")
    out["model.norm.weight"] = t.pop("model.norm.weight")
    head = t.pop("lm_head.weight", None)
    if head is not None:
        out["lm_head.weight"] = head
    return out
