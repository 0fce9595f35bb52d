"""Tensor- and expert-parallel inference by explicit sharding of Clover's fused projections.

`--tp N` (rank r of N holds):
* attention: its share of the query / gate / key / value heads (rows of each segment of the fused
  `qkv_proj`), the matching columns of `o_proj`;
* Gated DeltaNet: its share of the key heads and of the value heads grouped with them (rows of
  each segment of `in_proj` [q ; k ; v ; z ; b ; a], of the depthwise conv and its right branch,
  the per-head decay / calibration / scale), the matching columns of `out_proj`;
* MoE: every routed expert's and the shared expert's share of the intermediate columns (rows of
  gate_up, columns of down); the router, norms, embeddings and head are replicated.
Each mixer and each MoE then returns a partial sum: one all-reduce per block output (two per
decoder layer). The K/V cache holds the rank's KV heads, the GDN states its value heads.

`--ep N`: rank r holds experts [r E/N, (r+1) E/N) whole and its share of the shared expert's
columns; attention and GDN are replicated (so are their caches); every rank routes every token,
runs the pairs that fall on its experts and the MoE outputs are all-reduced (one per layer).

The weights are read straight from the checkpoint's safetensors, each rank only its slices (no
rank holds the whole model). Rank 0 alone runs the command: it tokenises, owns the engine / the
scheduler / the HTTP server and makes every decision; each of its forwards and cache operations
(new cache, append / select rows, start recording, rollback) is first broadcast as a command
(the step's token ids, padding and logits index as tensors) and the other ranks (`mirror`) run it
on their shard, so their collectives meet rank 0's in the same order.
"""

from __future__ import annotations

import atexit
import copy
import sys
import threading
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..models.cache_clover import CloverCache
from ..ops.moe import grouped_experts
from .plan import check_parallel, local_shape, shard_plan  # noqa: F401 - re-exported
from .runtime import launched


# ------------------------------------------------------------------------------------------------
# What each rank holds: per parameter, the index ranges (segments) it takes, concatenated
# ------------------------------------------------------------------------------------------------
def take(full, entry, rank: int) -> torch.Tensor:
    """This rank's piece of a tensor; `full` is a tensor or a safetensors slice (read lazily)."""
    if entry is None:
        return full[:] if not isinstance(full, torch.Tensor) else full
    if isinstance(entry, str):  # row-parallel bias: added once, by rank 0
        t = full[:] if not isinstance(full, torch.Tensor) else full
        return t if rank == 0 else torch.zeros_like(t)
    dim, segs = entry
    pieces = []
    for a, b in segs:
        idx = tuple([slice(None)] * dim + [slice(a, b)])
        pieces.append(full[idx])
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def local_config(config, tp: int):
    """The config of one rank's caches: its share of the KV heads and GDN heads."""
    c = copy.deepcopy(config)
    if tp > 1:
        c.num_key_value_heads //= tp
        c.linear_num_key_heads //= tp
        c.linear_num_value_heads //= tp
    return c


# ------------------------------------------------------------------------------------------------
# The sharded model
# ------------------------------------------------------------------------------------------------
class ExpertShard(nn.Module):
    """Experts [first, first + n) of `total` (EP): the pairs routed to them, the rest contributing 0."""

    def __init__(self, gate_up: nn.Parameter, down: nn.Parameter, first: int):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.first = gate_up, down, first

    def forward(self, x, top_idx, top_w):
        n = self.gate_up_proj.shape[0]
        mine = (top_idx >= self.first) & (top_idx < self.first + n)
        tok, slot = mine.nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if tok.numel():
            y = grouped_experts(x[tok], (top_idx[tok, slot] - self.first)[:, None], top_w[tok, slot][:, None],
                                self.gate_up_proj, self.down_proj)
            out.index_add_(0, tok, y)
        return out


def _all_reduce_output(group):
    def hook(module, inputs, output):
        dist.all_reduce(output, group=group)
        return output

    return hook


def _fix_attributes(model, config, tp: int, ep: int, rank: int) -> None:
    """Module attributes that follow the local shapes; the all-reduce hooks."""
    from ..models.modeling_clover import CloverAttention, CloverGatedDeltaNet, CloverSparseMoe

    n = max(tp, ep)
    for module in model.modules():
        if tp > 1 and isinstance(module, CloverAttention):
            module.heads //= tp
            module.kv_heads //= tp
            module.split = tuple(s // tp for s in module.split)
            module.register_forward_hook(_all_reduce_output(None))
        elif tp > 1 and isinstance(module, CloverGatedDeltaNet):
            module.k_heads //= tp
            module.v_heads //= tp
            module.key_dim //= tp
            module.value_dim //= tp
            module.conv_dim //= tp
            module.split = tuple(s // tp for s in module.split)
            module.register_forward_hook(_all_reduce_output(None))
        elif isinstance(module, CloverSparseMoe):
            if module.shared_expert is not None:  # its columns split under --tp and --ep alike
                module.shared_expert.inter //= n
            if ep > 1:
                module.experts = ExpertShard(module.experts.gate_up_proj, module.experts.down_proj,
                                             rank * config.num_experts // ep)
            module.register_forward_hook(_all_reduce_output(None))


def load_parallel(path, tp: int, ep: int, rank: int, device, dtype):
    """Rank `rank`'s shard of the model in folder `path`, read slice by slice from its safetensors.
    Without a process group (tests, the memory plan) the model has no collectives to run."""
    from safetensors import safe_open

    from ..models import CloverConfig, CloverForBlockDiffusion
    from ..utils.checkpoint_io import SafetensorsSource

    folder = Path(path)
    config = CloverConfig.from_pretrained(folder)
    check_parallel(config, tp, ep)
    with torch.device("meta"):
        model = CloverForBlockDiffusion(config)
    plan = shard_plan(config, tp, ep, rank)
    source = SafetensorsSource(folder)
    files: dict = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        key = name
        if key not in source.weight_map and name == "lm_head.weight" and config.tie_word_embeddings:
            key = "model.embed_tokens.weight"
        file = source.weight_map.get(key)
        if file is None:
            raise ValueError(f"{folder}: missing tensor {key}")
        if file not in files:
            files[file] = safe_open(folder / file, "pt")
        piece = take(files[file].get_slice(key), plan.get(name), rank)
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[leaf] = nn.Parameter(piece.to(device=device, dtype=dtype), requires_grad=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    _fix_attributes(model, config, tp, ep, rank)
    cache_config = local_config(config, tp)
    model.new_cache = lambda batch_size, capacity=256: CloverCache(cache_config, batch_size, capacity,
                                                                   device=device, dtype=dtype)
    model.parallel = {"tp": tp, "ep": ep, "rank": rank}
    return model


# ------------------------------------------------------------------------------------------------
# Rank 0 drives, the other ranks mirror its model and cache calls
# ------------------------------------------------------------------------------------------------
class SyncedCache(CloverCache):
    """Rank 0's cache: each call the engine makes on it (outside a forward) is sent to the other
    ranks first, which apply it to their own shard of the same cache."""

    def _init_sync(self, driver, cid: int):
        self._driver, self._cid = driver, cid
        weakref.finalize(self, driver.dead.append, cid)  # freed on every rank with the next command
        return self

    MIRRORED = ("append_rows", "select_rows", "start_recording", "rollback", "reserve")  # sent to every rank

    def restore(self, snap: dict) -> None:  # a snapshot holds rank 0's shard only
        raise NotImplementedError("CloverCache.restore is not mirrored across ranks (use start_recording / rollback)")


def _mirrored(name: str):
    """SyncedCache's `name`: CloverCache's, sent to the other ranks first unless inside a forward."""
    def method(self, *args, **local):  # `local`: how rank 0 computes it (rollback's states), not sent
        base = getattr(CloverCache, name)
        driver = getattr(self, "_driver", None)
        if driver is None or driver.inside:  # inside a forward: every rank does it already
            return base(self, *args, **local)
        with driver.lock:
            driver.send(("call", self._cid, name, [a._cid if isinstance(a, SyncedCache) else a for a in args]))
            return base(self, *args, **local)

    method.__name__ = method.__qualname__ = name
    return method


for _name in SyncedCache.MIRRORED:
    setattr(SyncedCache, _name, _mirrored(_name))
del _name


class Driver:
    """On rank 0: `model(...)` and `model.new_cache(...)` become commands broadcast to the other
    ranks (token ids, padding, logits index as tensors; the rest as a small object), then run
    locally; one lock keeps the command streams of all ranks in the same order."""

    def __init__(self, model, d, cache_config):
        self.model, self.d, self.cache_config = model, d, cache_config
        self.lock = threading.RLock()
        self.inside = False
        self.dead: list[int] = []
        self.next_id = 0
        self.forward = model.forward
        model.forward = self._forward
        model.new_cache = self._new_cache

    def send(self, cmd) -> None:
        dead = []
        while self.dead:  # finalizers may append from any thread
            dead.append(self.dead.pop())
        self.d.broadcast((dead, cmd))

    def _new_cache(self, batch_size: int, capacity: int = 256):
        with self.lock:
            self.next_id += 1
            self.send(("cache", self.next_id, batch_size, capacity))
            cache = SyncedCache(self.cache_config, batch_size, capacity, device=self.d.device, dtype=self.model.dtype)
            return cache._init_sync(self, self.next_id)

    def _forward(self, input_ids, cache=None, **kw):
        with self.lock:
            tensors = {"input_ids": input_ids, **{k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}}
            rest = {k: v for k, v in kw.items() if not isinstance(v, torch.Tensor)}
            meta = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
            self.send(("forward", cache._cid if cache is not None else None, meta, rest))
            for v in tensors.values():
                self.d.broadcast_tensor(v.contiguous())
            self.inside = True
            try:
                return self.forward(tensors.pop("input_ids"), cache=cache, **tensors, **rest)
            finally:
                self.inside = False

    def release(self) -> None:
        """Let the other ranks' `mirror` return (this model is done)."""
        with self.lock:
            self.send(("stop",))


def mirror(model, d, cache_config) -> None:
    """On ranks > 0: run rank 0's model and cache calls on this rank's shard until it stops."""
    caches: dict[int, CloverCache] = {}
    with torch.inference_mode():
        while True:
            dead, cmd = d.broadcast(None)
            for cid in dead:
                caches.pop(cid, None)
            if cmd[0] == "stop":
                return
            if cmd[0] == "cache":
                _, cid, batch, capacity = cmd
                caches[cid] = CloverCache(cache_config, batch, capacity, device=d.device, dtype=model.dtype)
            elif cmd[0] == "call":
                _, cid, name, args = cmd
                if name == "append_rows":
                    args = [caches[args[0]]]
                getattr(caches[cid], name)(*args)
            else:
                _, cid, meta, rest = cmd
                tensors = {k: d.broadcast_tensor(torch.empty(shape, dtype=dtype, device=d.device))
                           for k, (shape, dtype) in meta.items()}
                model(tensors.pop("input_ids"), cache=caches[cid] if cid is not None else None, **tensors, **rest)


def attach(model, d):
    """Rank 0: the model, its calls now mirrored on every rank (call `.driver.release()` when done,
    or let the process end). Other ranks: serve rank 0's calls, then None."""
    cache_config = local_config(model.config, model.parallel["tp"])
    if not d.main:
        mirror(model, d, cache_config)
        return None
    model.driver = Driver(model, d, cache_config)
    return model


def load(args):
    """(model, tokenizer) for a command with --model / --device / --tp / --ep: the plain
    `clover.load` in one process. Under torchrun, rank 0 gets its shard of the model, whose forward
    and caches drive the other ranks, and runs the command (tokenises, decodes, prints, serves);
    the other ranks load their shards, mirror rank 0's calls and exit when rank 0 is done."""
    from ..api import load as plain_load
    from . import runtime

    tp, ep = getattr(args, "tp", 1), getattr(args, "ep", 1)
    if tp < 1 or ep < 1:
        raise ValueError(f"--tp and --ep must be >= 1, got {tp} and {ep}")
    if not launched():
        if tp > 1 or ep > 1:
            raise ValueError(f"--tp/--ep {max(tp, ep)} needs that many processes: launch with "
                             f"torchrun --nproc-per-node {max(tp, ep)} -m clover ...")
        return plain_load(args.model, args.device)
    from transformers import AutoTokenizer

    from ..api import DEFAULT_MODEL

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    d = runtime.from_env(device)
    if max(tp, ep) != d.world:
        raise ValueError(f"--tp {tp} / --ep {ep}: the launch has {d.world} processes; give --tp {d.world} or --ep {d.world}")
    folder = Path(args.model) if args.model else DEFAULT_MODEL
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: no config.json (not a model folder)")
    dtype = torch.bfloat16 if d.device.type == "cuda" else torch.float32
    try:
        model = attach(load_parallel(folder, tp, ep, d.rank, d.device, dtype), d)
    except BaseException:  # Ctrl-C reaches every rank: an interrupted rank > 0 ends its group too
        runtime.shutdown(d)
        raise
    if model is None:  # a rank > 0, after rank 0 finished
        runtime.shutdown(d)
        sys.exit(0)
    held = [model.driver]

    def finish():  # at exit: the driver (and with it the model) is let go before the group ends
        driver = held.pop()
        try:
            driver.release()
        except RuntimeError:  # the other ranks are gone already (interrupted): nobody to release
            pass
        driver.model.driver = driver.model = None
        runtime.shutdown(driver.d)

    atexit.register(finish)
    return model, AutoTokenizer.from_pretrained(folder)
