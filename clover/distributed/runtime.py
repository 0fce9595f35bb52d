"""The process group of a `torchrun` launch: rank, world size, device and device mesh.

`from_env()` returns None outside torchrun (or with one process): the caller then runs its plain
single-process path. With several processes it initialises the default group (NCCL when the run is
on CUDA, gloo on CPU), binds each process to cuda:LOCAL_RANK on GPU and builds a 1-D DeviceMesh.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    mesh: object  # torch.distributed.device_mesh.DeviceMesh

    @property
    def main(self) -> bool:
        return self.rank == 0

    # ---- small collectives on Python numbers / objects ----
    def all_sum(self, x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t)

    def broadcast(self, obj):
        """`obj` from rank 0 (a picklable object of our own, never read from a file)."""
        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.backend == "nccl" else None)
        return box[0]

    def broadcast_tensor(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0)
        return t

    def barrier(self) -> None:
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.local_rank])
        else:
            dist.barrier()

    def shard_rows(self, batch: int) -> tuple[int, int]:
        """This rank's contiguous rows of a batch of `batch` (the first ranks take one more when uneven)."""
        base, extra = divmod(batch, self.world)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (self.rank < extra)


def launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def from_env(device: str = "cpu") -> Dist | None:
    """The process group of this torchrun launch (initialised once), or None for one process."""
    if not launched():
        return None
    from torch.distributed.device_mesh import init_device_mesh

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("device cuda requested but CUDA is not available")
        dev, backend = torch.device("cuda", local), "nccl"
        torch.cuda.set_device(dev)
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=dev if backend == "nccl" else None)
    world = dist.get_world_size()
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    return Dist(dist.get_rank(), world, local, dev, backend, mesh)


def shutdown(d: Dist | None = None) -> None:
    """Destroy the process group now, gloo's threads with it. `destroy_process_group` alone leaves a
    group alive while a DeviceMesh holds it (`d.mesh`, and DTensor's caches of specs on the mesh);
    then its threads end only in interpreter finalisation, where rank 0 of `generate --tp 2`
    aborted about one run in a hundred ("terminate called without an active exception", SIGABRT
    after its output). So the mesh is dropped, DTensor's caches emptied and the garbage collected.
    The caller drops what else holds the mesh (a model with DTensor parameters) before calling."""
    if d is not None:
        d.mesh = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _clear_dtensor_caches()
    gc.collect()


def _clear_dtensor_caches() -> None:
    """DTensor memoises per mesh (sharding propagation in C++ and Python, redistribution planners,
    transform plans, mesh topology), and every entry holds its mesh (FSDP and --ep parameters are
    DTensors): all emptied so the mesh can go. These are torch's private names, each looked up
    before use; tests/exit_probe notices a torch release that moves or adds one."""
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if redistribute is None:  # DTensor never used
        return
    import torch.distributed.tensor.debug as dtensor_debug

    for clear in (getattr(dtensor_debug, "_clear_sharding_prop_cache", None),
                  getattr(redistribute, "clear_redistribute_planner_cache", None)):
        if clear is not None:
            clear()
    for obj in gc.get_objects():
        if type(obj) is functools._lru_cache_wrapper and getattr(obj, "__module__", "").startswith("torch.distributed"):
            obj.cache_clear()
