"""Masked softmax attention with grouped K/V heads: block-causal attention in the full-attention
layers and the intra-block bidirectional branch of the GDN layers share it."""

from .naive import naive_masked_attention
from .sdpa import masked_attention

__all__ = ["masked_attention", "naive_masked_attention"]
