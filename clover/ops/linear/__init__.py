"""Dense projections: `naive` is the reference (F.linear); `packed` runs fp32 on CPU through oneDNN
with the weight packed once (faster from 8 rows on)."""

from .naive import naive_linear
from .packed import packed_linear, worth_packing

__all__ = ["naive_linear", "packed_linear", "worth_packing"]
