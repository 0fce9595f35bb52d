"""What a model's first forward would otherwise do slowly, done when a command starts (`clover serve`
before it serves, `clover generate` before it decodes): never inside a request or the first decode."""

from __future__ import annotations


def prepare(model) -> None:
    """The C++ CPU kernels built or loaded (said on stderr when they compile) and the int4 layers'
    kernel layouts packed."""
    from ..ops.linear import tiled
    from ..quant.modules import pack_int4_weights

    tiled.prepare_for(model)
    if hasattr(model, "modules"):
        pack_int4_weights(model)
