"""Masked softmax attention with grouped K/V heads: block-causal attention in the full-attention
layers and the intra-block bidirectional branch of the GDN layers share it."""

from .local import local_window_attention
from .naive import naive_masked_attention
from .sdpa import masked_attention

__all__ = ["local_window_attention", "masked_attention", "naive_masked_attention"]
