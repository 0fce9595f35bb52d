"""The config of a public block-diffusion family, read from its Hugging Face folder as published.

Torch-free (so `clover info` counts parameters without loading a model). A family's config keeps
every field of config.json (`raw`) and exposes the ones its model needs with the published
defaults of that family's own configuration class; `param_shapes()` gives {published tensor name:
shape}, the names and shapes its safetensors hold, so counts and loading agree by construction.
"""

from __future__ import annotations

from pathlib import Path


class FamilyConfig:
    """Base of the family configs: `DEFAULTS` are the published configuration class's defaults."""

    model_type: str = ""
    architectures: tuple[str, ...] = ()
    DEFAULTS: dict = {}

    def __init__(self, **values):
        self.raw = dict(values)
        for key, default in self.DEFAULTS.items():
            value = values.get(key)
            setattr(self, key, default if value is None else value)
        self.finish()

    def finish(self) -> None:
        """Derived fields (head_dim, ...) after the defaults are in."""
        if getattr(self, "head_dim", None) is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        rope = self.raw.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if kind != "default":
            raise ValueError(f"rope_scaling type {kind!r} is not supported (only the default RoPE)")
        kinds = set(self.raw.get("layer_types") or ["full_attention"])
        if self.raw.get("use_sliding_window") or kinds != {"full_attention"}:
            raise ValueError("sliding-window attention is not supported (every layer must be full attention)")
        if self.raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {self.raw.get('hidden_act')!r} is not supported (only silu)")

    @classmethod
    def from_dict(cls, values: dict) -> "FamilyConfig":
        return cls(**values)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "FamilyConfig":
        from ..utils.checkpoint import read_config

        return cls.from_dict(read_config(folder, clover=False))

    def to_dict(self) -> dict:
        out = dict(self.raw)
        out.update({k: getattr(self, k) for k in self.DEFAULTS})
        return out

    # ---- sizes -----------------------------------------------------------------------------------
    def param_shapes(self) -> dict[str, tuple[int, ...]]:  # pragma: no cover - every family defines it
        raise NotImplementedError

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * getattr(self, "partial_rotary_factor", 1.0))

    def is_moe_layer(self, i: int) -> bool:
        return False

    def routed_expert_count(self) -> tuple[int, int]:
        """(experts per MoE layer, experts each token uses); (0, 0) for a dense model."""
        return 0, 0

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * bytes_per_value


def swiglu_shapes(prefix: str, hidden: int, inter: int) -> dict:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def expert_shapes(prefix: str, experts: int, hidden: int, inter: int) -> dict:
    out = {}
    for e in range(experts):
        out.update(swiglu_shapes(f"{prefix}experts.{e}.", hidden, inter))
    return out


def qwen_layout_shapes(c, qkv_bias: bool, o_bias: bool, qk_norm: bool, mlp) -> dict:
    """{name: shape} of a Qwen2 / Qwen3 / Qwen3-MoE style checkpoint; `mlp(i, prefix)` gives layer i's MLP."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    out = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out[a + name + ".weight"] = (rows, h)
            if qkv_bias:
                out[a + name + ".bias"] = (rows,)
        out[a + "o_proj.weight"] = (h, q)
        if o_bias:
            out[a + "o_proj.bias"] = (h,)
        if qk_norm:
            out[a + "q_norm.weight"] = out[a + "k_norm.weight"] = (c.head_dim,)
        out.update(mlp(i, f"model.layers.{i}.mlp."))
        out[f"model.layers.{i}.input_layernorm.weight"] = (h,)
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    return out
