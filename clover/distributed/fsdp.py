"""FSDP2 for training: parameters, gradients and optimiser state sharded over the data-parallel mesh.

`fully_shard` wraps every decoder layer (its parameters are all-gathered just before it runs and
freed after, gradients reduce-scattered as its backward ends), then the root module (embeddings,
final norm, head: the tied embedding / head pair stays in one group). On GPU with `bf16` the
parameters are gathered and computed in bf16 while gradients are reduced in fp32 and the sharded
master weights and Adam moments stay fp32 (MixedPrecisionPolicy). The gradient average over ranks
is FSDP's own (reduce-scatter with the world size as divisor); `clover.distributed.shard.Shard`
makes each rank's loss its share of the global-batch loss, so scaling it by the world size makes
that average the gradient of one process on the whole batch.
"""

from __future__ import annotations

import torch

from .shard import Shard
from .runtime import Dist


def shard_model(model, d: Dist, bf16: bool = False, ignored: list | None = None):
    """`ignored`: parameters FSDP leaves alone (the expert-parallel experts, clover/distributed/expert.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if bf16 and d.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    skip = set(ignored or ())
    for layer in model.model.layers:
        fully_shard(layer, mesh=d.mesh, mp_policy=mp, ignored_params=skip & set(layer.parameters()) or None)
    fully_shard(model, mesh=d.mesh, mp_policy=mp, ignored_params=skip or None)
    return model


def batch_shard(d: Dist, batch: int) -> Shard:
    lo, hi = d.shard_rows(batch)
    return Shard(lo, hi, d.world, d.all_sum)


def set_gradient_sync(model, sync: bool) -> None:
    """Reduce gradients only after the last micro-batch of an accumulated step (FSDP2 keeps the
    unsharded gradients in between)."""
    model.set_requires_gradient_sync(sync)


def full_tensor(x):
    """A DTensor (e.g. the clipped gradient norm) as a plain tensor; anything else unchanged."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x
