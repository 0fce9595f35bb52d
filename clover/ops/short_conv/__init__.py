"""The GDN short convolution of block diffusion: a causal depthwise conv over the left context
(crossing blocks, fed by the cached conv state) plus a right-side branch that only sees later
tokens of the same block.

    y_t = sum_{j=0}^{K-1} w[K-1-j] x_{t-j}  +  sum_{j=1}^{K-1} r[j-1] x_{t+j} [same block as t]

x arrives with its K-1 left-context columns prepended: x_ext [B, C, K-1+L]; window_ids [L] gives
each of the L output columns its block (equal ids = same block)."""

from .fused import block_short_conv
from .naive import naive_block_short_conv

__all__ = ["block_short_conv", "naive_block_short_conv"]
