"""INT4 weight-only quantisation: the stored format and kernels (`int4`), the int4 twins of the
model's layers (`modules`) and GPTQ (`gptq`). Nothing here imports the model (the model file
imports this package to install the twins); streaming checkpoint quantisation, which loads models,
is `clover/convert/quantize.py`."""

import logging

from .int4 import dequantize, pack_int4, quantize_rtn, unpack_int4
from .modules import (
    QUANT_METHOD, Int4Experts, Int4Linear, Int4Weight, apply_quantization, quantized_targets, set_int4_kernel,
)


class _KnownMethodFilter(logging.Filter):
    """transformers warns that it does not know `clover_int4` and 'will skip the quantization':
    Clover's own model class applies it (CloverForBlockDiffusion.__init__), so the line misleads."""

    def filter(self, record):
        return QUANT_METHOD not in record.getMessage()


logging.getLogger("transformers.quantizers.auto").addFilter(_KnownMethodFilter())

__all__ = [
    "QUANT_METHOD", "Int4Experts", "Int4Linear", "Int4Weight", "apply_quantization", "dequantize",
    "pack_int4", "quantize_rtn", "quantized_targets", "set_int4_kernel", "unpack_int4",
]
