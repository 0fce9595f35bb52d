"""What the public block-diffusion families share: the block-causal layout of one forward, the
per-sequence K/V cache, RMSNorm, SwiGLU, routed experts, the decoder layer and the loader.

One forward serves every use: `input_ids` [B, L] at `positions` (absolute token positions; by
default each row's committed length onward, left padding skipped). A query sees every committed
token of its row (the cache) and the new tokens whose block (position // block_size) is not after
its own: a block sees earlier blocks and all of itself. `commit=True` writes the new tokens' K/V
into the cache (a finished block, re-run clean); `commit=False` runs a draft block against the
cache and leaves it as it was. The model families differ only in their layers (modeling_sdar.py,
modeling_fast_dllm.py, modeling_llada2.py) and in how their logits are read (`shift`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.block_attention import masked_attention
from .cache_rows import RowCache
from .modeling_clover import CloverExperts, apply_partial_rope, commit_slots, rope_cos_sin, rope_frequencies


# ------------------------------------------------------------------------------------------------
# Cache
# ------------------------------------------------------------------------------------------------
class FamilyCache(RowCache):
    """Committed K/V of every attention layer, one row per sequence ({layer: [B, Hkv, capacity, D]});
    `lens` holds each row's committed length (rows advance independently). The method names are
    CloverCache's (clover/models/cache_clover.py), so the engine's calls work on either; attention
    alone needs no records: a rollback is a length."""

    STORES = ("key", "value")

    def __init__(self, config, batch_size: int, capacity: int = 256, device=None, dtype=torch.float32):
        super().__init__(config, batch_size, capacity, device, dtype)
        shape = (batch_size, config.num_key_value_heads, capacity, config.head_dim)
        self.key = {i: torch.zeros(shape, dtype=dtype, device=self.device) for i in range(config.num_hidden_layers)}
        self.value = {i: torch.zeros(shape, dtype=dtype, device=self.device) for i in range(config.num_hidden_layers)}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
              slots: torch.Tensor) -> None:
        """k, v [B, Hkv, L, D]: column cols[n] of row rows[n] goes to slot slots[n]."""
        self.key[layer].permute(0, 2, 1, 3)[rows, slots] = k.permute(0, 2, 1, 3)[rows, cols].to(self.dtype)
        self.value[layer].permute(0, 2, 1, 3)[rows, slots] = v.permute(0, 2, 1, 3)[rows, cols].to(self.dtype)

    # ---- snapshot / rollback (self-speculation) ------------------------------------------------
    def snapshot(self) -> dict:
        return {"lens": self.lens.clone()}

    def restore(self, snap: dict) -> None:
        self.lens = snap["lens"].clone()

    def start_recording(self) -> None:
        self.recording = True
        self._record_lens = self.lens.clone()

    def trim_records(self, rows: int) -> None:
        """Nothing is recorded (attention forgets a tail by its length)."""

    def rollback(self, keep: torch.Tensor) -> None:
        """After a recorded forward that committed n tokens per row, keep only the first `keep[b]`."""
        if not self.recording:
            raise RuntimeError("rollback() needs a forward recorded after start_recording()")
        self.lens = self._record_lens + keep.to(self.device)
        self.recording = False


# ------------------------------------------------------------------------------------------------
# Layout of one forward
# ------------------------------------------------------------------------------------------------
@dataclass
class Step:
    positions: torch.Tensor  # [B, L] absolute positions (RoPE, block ids)
    mask: torch.Tensor  # [B, 1, L, prefix + L] True = may attend
    prefix: int  # cache slots read (the longest row's committed length)
    cache: FamilyCache | None
    commit: tuple | None  # (rows, cols, slots) of the valid new tokens when they are committed
    rope: tuple | None = None
    slots: torch.Tensor | None = None  # static: [B, L] the cache slot each column's K/V is written to
    select: torch.Tensor | None = None  # [B, n] the only columns whose outputs a layer returns (`hidden`)
    inv_freq: torch.Tensor | None = None  # the model's RoPE frequencies (`rope_frequencies`), made once

    def rope_for(self, rotary_dim: int, theta: float, dtype):
        """(cos, sin) [B, L, rotary_dim] at the step's positions, once per step."""
        if self.rope is None:
            made = self.inv_freq is not None and 2 * self.inv_freq.numel() == rotary_dim
            self.rope = rope_cos_sin(self.positions, rotary_dim, theta, dtype, self.inv_freq if made else None)
        return self.rope


def block_step(input_ids, block_size: int, positions=None, cache=None, commit: bool | int = False, pad=None) -> Step:
    """`commit`: True commits every new column, an int the first `commit` columns (a clean segment
    before a draft window in one forward; the draft sees them, being in a later block)."""
    batch, length = input_ids.shape
    device = input_ids.device
    lens = cache.lens if cache is not None else torch.zeros(batch, dtype=torch.long, device=device)
    valid = ~pad if pad is not None else torch.ones(batch, length, dtype=torch.bool, device=device)
    order = valid.long().cumsum(1) - 1  # index of each real token among its row's new tokens
    if positions is None:
        positions = lens[:, None] + order.clamp_min(0)
    blk = torch.div(positions, block_size, rounding_mode="floor")
    new = (blk[:, None, :] <= blk[:, :, None]) & valid[:, None, :]
    if pad is not None:  # a padded query looks at itself only, so no row of the mask is empty
        new = new | (torch.eye(length, dtype=torch.bool, device=device)[None] & pad[:, :, None])
    prefix = cache.max_len() if cache is not None else 0
    if prefix:
        old = (torch.arange(prefix, device=device)[None, :] < lens[:, None])[:, None, :].expand(-1, length, -1)
        new = torch.cat([old, new], dim=-1)
        cache.reserve(length)  # the new columns' K/V sit after the prefix during the forward (extend_kv)
    committed = None
    if commit is not False and commit != 0:
        if cache is None:
            raise ValueError("commit needs a cache")
        upto = length if commit is True else int(commit)
        cache.reserve(upto)
        rows, cols = (valid & (torch.arange(length, device=device) < upto)).nonzero(as_tuple=True)
        committed = (rows, cols, lens[rows] + order[rows, cols])
    return Step(positions, new[:, None], prefix, cache, committed)


def static_block_step(input_ids, block_size: int, cache: FamilyCache, pad=None, span: int = 0) -> Step:
    """The layout of a compiled step (fixed shapes, no host sync): every column's K/V is written into
    the cache in place, the committed (clean) columns at their slots, the draft's in scratch slots
    past the row's new length (no later query reads them; later commits overwrite them), and the
    keys are the cache's first `span` slots (0: its whole capacity; the caller makes sure every
    row's length plus the step's columns fit), masked past each row's length. The same positions
    and block mask as `block_step`; the caller advances the lengths after the forward."""
    batch, length = input_ids.shape
    device = input_ids.device
    lens = cache.lens
    valid = ~pad if pad is not None else torch.ones(batch, length, dtype=torch.bool, device=device)
    positions = lens[:, None] + (valid.long().cumsum(1) - 1).clamp_min(0)
    blk = torch.div(positions, block_size, rounding_mode="floor")
    new = (blk[:, None, :] <= blk[:, :, None]) & valid[:, None, :]
    if pad is not None:  # a padded query looks at itself only (and the committed prefix)
        new = new | (torch.eye(length, dtype=torch.bool, device=device)[None] & pad[:, :, None])
    span = span or cache.capacity
    old = (torch.arange(span, device=device)[None, :] < lens[:, None])[:, None, :].expand(-1, length, -1)
    slots = commit_slots(lens, pad, length)  # real columns at lens + their order, pads after every real one
    mask = old.scatter(2, slots[:, None, :].expand(-1, length, -1), new)
    return Step(positions, mask[:, None], span, cache, None, slots=slots)


# ------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """w * x / rms(x), the statistics in fp32 (Qwen2/3 and Ling convention)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], None, self.eps).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(CloverExperts):
    """Routed experts stored fused (gate_up [E, 2I, H], down [E, H, I]), run as Clover's are
    (clover.ops.moe: grouped eagerly, gathered or tiled in a compiled graph; int4 twin
    quant.Int4Experts); the loader stacks the published per-expert tensors into these."""


def attend(q, k, v, step: Step, layer: int, rotary_dim: int, theta: float):
    """q [B, H, L, D], k/v [B, Hkv, L, D] of the new tokens -> attention output [B, L, H*D]:
    RoPE at the step's positions, the committed K/V in front, the block mask; commits if asked.
    With `step.select` [B, n], q may be of those columns alone ([B, H, n, D]; the output is theirs)."""
    cos, sin = step.rope_for(rotary_dim, theta, q.dtype)
    k = apply_partial_rope(k, cos, sin)
    if step.select is not None and q.shape[2] != k.shape[2]:  # the selected columns' queries alone
        q = apply_partial_rope(q, take_columns(cos, step.select, 1), take_columns(sin, step.select, 1))
    else:
        q = apply_partial_rope(q, cos, sin)
        if step.select is not None:
            q = take_columns(q, step.select, 2)
    keys, values = k, v
    if step.slots is not None:  # static: every column written in place, then the step's span of slots read
        step.cache.write_kv(layer, step.slots, k, v)
        keys, values = step.cache.kv(layer, k.dtype, step.prefix)
    elif step.prefix:  # [prefix ; new] in the cache's own storage, no copy of it
        keys, values = step.cache.extend_kv(layer, step.prefix, k, v)
    mask = step.mask
    if step.select is not None:  # every column's K/V above; queries only for the selected columns
        mask = take_columns(mask, step.select, 2)
    out = masked_attention(q, keys, values, mask, q.shape[-1] ** -0.5)
    if step.commit is not None:  # after reading the scratch slots
        step.cache.write(layer, k, v, *step.commit)
    return out.transpose(1, 2).flatten(2)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)). `attn_name` is the published
    name of the attention module (`self_attn` in the Qwen layouts, `attention` in Ling's)."""

    def __init__(self, attn_name: str, attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.attn_name = attn_name
        self.add_module(attn_name, attn)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, step: Step):
        """x [B, L, H] -> [B, L, H], or [B, n, H] of the columns `step.select` (their K/V still
        computed from every column)."""
        kept = x if step.select is None else take_columns(x, step.select, 1)
        x = kept + getattr(self, self.attn_name)(self.input_layernorm(x), step)
        return x + self.mlp(self.post_attention_layernorm(x))


def take_columns(t: torch.Tensor, cols: torch.Tensor, dim: int) -> torch.Tensor:
    """The columns `cols` [B, n] of `t` [B, ..., L (at dim), ...], per row."""
    shape = [1] * t.dim()
    shape[0], shape[dim] = cols.shape
    index = cols.view(shape).expand(*t.shape[:dim], cols.shape[1], *t.shape[dim + 1:])
    return t.gather(dim, index)


def tail_columns(ids: torch.Tensor, keep: int) -> torch.Tensor | None:
    """[R, keep] the last `keep` columns of ids [R, L] (None: all, when keep is 0 or L)."""
    rows, width = ids.shape
    return torch.arange(width - keep, width, device=ids.device).expand(rows, keep) if 0 < keep < width else None



class Backbone(nn.Module):
    """`model.<embed_name>`, `model.layers`, `model.norm` (the published names)."""

    def __init__(self, embed_name: str, vocab: int, hidden: int, layers: list, eps: float):
        super().__init__()
        self.embed_name = embed_name
        self.add_module(embed_name, nn.Embedding(vocab, hidden))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps)

    @property
    def embed(self) -> nn.Embedding:
        return getattr(self, self.embed_name)


# ------------------------------------------------------------------------------------------------
# The model every family subclasses
# ------------------------------------------------------------------------------------------------
class BlockFamilyModel(nn.Module):
    """A family's causal-LM: subclasses set the family's properties and build `self.model`.

    Family properties (class attributes): `shift` (True: the logits at position i predict token
    i+1, as in Clover and Fast-dLLM v2; False: they predict token i itself, the mask's own
    position), `block_align` ("absolute": blocks at k*B from the first prompt token, the prompt's
    last partial block completed by generation), `mask_token` / `mask_token_id` (published),
    `default_block_size`, `default_threshold`, `modes` (Clover's decoding modes that mean something
    for the family: `ar` and `self_spec` need the shift, where block size 1 is the AR model),
    `published_decoding` (the strategies its own generate code offers)."""

    config_class = None
    family = ""
    shift = False
    block_align = "absolute"
    mask_token = ""
    mask_token_id = -1
    default_block_size = 32
    default_threshold = 0.9
    modes = ("low_confidence",)
    published_decoding: tuple = ()
    embed_name = "embed_tokens"

    def __init__(self, config):
        super().__init__()
        self.config = config
        c = config
        self.model = Backbone(self.embed_name, c.vocab_size, c.hidden_size,
                              [self.build_layer(i) for i in range(c.num_hidden_layers)], c.rms_norm_eps)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(c.rotary_dim, c.rope_theta), persistent=False)

    def build_layer(self, i: int) -> nn.Module:  # pragma: no cover - every family defines it
        raise NotImplementedError

    @property
    def block_size(self) -> int:
        return self.config.block_size if getattr(self.config, "block_size", None) else self.default_block_size

    def head_weight(self) -> torch.Tensor:
        return self.model.embed.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def new_cache(self, batch_size: int, capacity: int = 256) -> FamilyCache:
        p = self.model.embed.weight  # the model's dtype (the head may be int4)
        return FamilyCache(self.config, batch_size, capacity, p.device, p.dtype)

    def forward(self, input_ids, positions=None, cache=None, commit: bool | int = False,
                block_size: int | None = None, pad=None, hidden_only: bool = False, select=None):
        """Logits [B, L, V] of `input_ids` [B, L] (see the module docstring); `pad` [B, L] bool marks
        left padding; `commit` True commits every column, an int the first `commit` (a finished
        block and the next draft window in one forward); `hidden_only` returns the final hidden
        states instead; `select` [B, n]: those columns' only (`hidden`)."""
        step = block_step(input_ids, block_size or self.block_size, positions, cache, commit, pad)
        x = self.hidden(input_ids, step, select)
        if step.commit is not None:
            cache.advance(torch.bincount(step.commit[0], minlength=cache.batch_size))
        return x if hidden_only else self.logits(x)

    def static_forward(self, input_ids, cache: FamilyCache, block_size: int, pad=None, keep: int = 0, span: int = 0,
                       select: torch.Tensor | None = None):
        """Logits of the last `keep` columns (0: all) of a compiled step (`static_block_step`, its
        attention over the first `span` cache slots, 0: all): every column's K/V written into the
        cache in place; the caller then advances the lengths by the clean columns. The last layer's
        queries, MLP and the head run only on the columns whose logits are returned: the kept ones,
        or `select` [B, n] (instead of `keep`: those columns' logits, [B, n, V])."""
        if select is None:  # the last layer and the head on the kept columns only
            select = tail_columns(input_ids, keep)
        return self.logits(self.hidden(input_ids, static_block_step(input_ids, block_size, cache, pad, span), select))

    def hidden(self, input_ids, step: Step, select: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of a forward laid out by `step`; with `select` [B, n], those of
        the columns it names (the last layer returns only them; the K/V of every column are written)."""
        x = self.model.embed(input_ids)
        step.inv_freq = self.inv_freq
        *layers, last = self.model.layers
        for layer in layers:
            x = layer(x, step)
        step.select = select
        return self.model.norm(last(x, step))

    def logits(self, hidden) -> torch.Tensor:
        """The head: the tied embeddings, or `lm_head` (a module: an int4 twin where quantised)."""
        return self.lm_head(hidden) if hasattr(self, "lm_head") else F.linear(hidden, self.model.embed.weight)

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, folder, dtype: torch.dtype | None = None, device=None):
        """The model of a Hugging Face folder as published (no remote code runs): config.json through
        this family's config class, the safetensors by their published names."""
        config = cls.config_class.from_pretrained(folder)
        return cls.from_state_dict(config, read_weights(folder), dtype, device)

    @classmethod
    def from_state_dict(cls, config, state: dict, dtype=None, device=None):
        """The model of `state` (published names, or Clover's for an int4 folder of `clover quantize`:
        config.json's `quantization_config` swaps in the int4 modules, whose stored parts keep their
        dtypes) in `dtype` (default: the embeddings')."""
        with torch.device("meta"):
            model = cls(config)
        quantization = config.raw.get("quantization_config")
        if quantization:
            from ..quant import apply_quantization

            apply_quantization(model, quantization)
        mapped = map_published(state, config)
        dtype = dtype or mapped[f"model.{cls.embed_name}.weight"].dtype  # the weights' (a router bias may be fp32)
        mapped = {k: v.to(device=device or "cpu", dtype=dtype if v.is_floating_point() and not _int4_part(k)
                          else v.dtype) for k, v in mapped.items()}
        missing = [k for k in model.state_dict() if k not in mapped]
        extra = [k for k in mapped if k not in model.state_dict()]
        if missing or extra:
            from ..utils.checkpoint import CheckpointError

            raise CheckpointError(f"weights do not fit the {cls.family} config: "
                                  f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                                  f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
        model.load_state_dict(mapped, strict=True, assign=True)
        model.inv_freq = rope_frequencies(config.rotary_dim, config.rope_theta, device or "cpu")  # not stored
        return model.eval()


def _int4_part(name: str) -> bool:
    """A stored part of an int4 weight (quant/int4.py), kept in its own dtype."""
    return name.rsplit(".", 1)[-1] in ("qweight", "scales", "qzeros")


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def map_published(state: dict, config) -> dict:
    """Published tensor names -> this model's (`published_plan`), built from `state`."""
    return {name: build(state.__getitem__) for name, build in published_plan(list(state), config).items()}


def published_plan(names: list[str], config) -> dict:
    """This model's tensor names, in order, each with how to build it from the published tensors
    (`build(get)`, `get(published name) -> tensor`): per-expert gate/up/down stacked into the fused
    gate_up_proj / down_proj (already fused tensors pass through); a tied head's copy dropped; a
    router's expert bias that a checkpoint leaves out is zero (its initial value). Built one at a
    time, a whole model never needs to be in memory (convert/quantize.py streams it)."""
    out, experts = {}, {}
    for name in names:
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = name
        elif not (name == "lm_head.weight" and config.tie_word_embeddings):
            out[name] = lambda get, name=name: get(name)
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        missing = next(((e, p) for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")
                        if (e, p) not in parts), None)
        if missing is not None:
            from ..utils.checkpoint import CheckpointError

            raise CheckpointError(f"{prefix}: expert tensor {missing} missing")
        out[prefix + ".gate_up_proj"] = lambda get, parts=parts, n=n: torch.stack(
            [torch.cat([get(parts[(e, "gate_proj")]), get(parts[(e, "up_proj")])]) for e in range(n)])
        out[prefix + ".down_proj"] = lambda get, parts=parts, n=n: torch.stack(
            [get(parts[(e, "down_proj")]) for e in range(n)])
    for i in range(config.num_hidden_layers):
        name = f"model.layers.{i}.mlp.gate.expert_bias"
        if config.model_type == "llada2_moe" and config.is_moe_layer(i) and name not in out:
            out[name] = lambda get: torch.zeros(config.num_experts)
    return out


def read_weights(folder) -> dict:
    from safetensors.torch import load_file

    from ..utils.checkpoint import weight_files

    state = {}
    for f in weight_files(folder):
        state.update(load_file(str(f)))
    return state
