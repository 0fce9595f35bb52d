"""A compiled graph loaded from the on-disk caches without tracing it again.

The compiling child (`warm`) compiles through inductor, whose AOT autograd cache keeps each
compiled graph (its runtime wrappers and its inductor module) under a key. The child records
that key (`recording`) and, for a model shape, how its Replay fetches the graph's inputs (which
weight by name, which tensor of the call by path, `shape_info`): JSON, sent to the server and
noted on disk beside the shape. The server then loads the graph by its key (`load`: an unpickle
and a library load, no dynamo trace, no make_fx, no inductor lowering) and builds the Replay
from the notes (`load_replay`), where a traced load (`CompileState.compile_shape` on a cache hit)
is a full dynamo trace holding the GIL. Anything that does not fit (a weight laid out otherwise,
an entry gone from the cache) gives None: the shape is then compiled the traced way.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from .replay import Replay, named_weights

AOT_ARTIFACT = "aot_autograd"  # the artifact type torch's cache manager records AOT autograd entries under


@contextlib.contextmanager
def recording():
    """Inside: the AOT autograd cache keys the compiles write or read, listed in what it yields at the end."""
    from torch.compiler._cache import CacheArtifactManager

    found: list = []
    with CacheArtifactManager.with_fresh_cache():
        yield found
        found += sorted({a.key for a in CacheArtifactManager._new_cache_artifacts.get(AOT_ARTIFACT, ())})


def _layout(t: torch.Tensor) -> list:
    return [list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch.")]


def shape_info(replay, aot_keys: list) -> dict | None:
    """What `load_replay` needs for a shape whose compile recorded `aot_keys`: None unless the shape
    has a Replay and the compile was one graph."""
    if not isinstance(replay, Replay) or len(aot_keys) != 1:
        return None
    records = None
    if replay.records:
        records = [[layer, kind.__module__, kind.__qualname__, list(fields)]
                   for layer, (kind, fields) in replay.records.items()]
        if any(not r[1].startswith("clover.") for r in records):
            return None
    return {"aot": aot_keys[0], "args": len(replay.args),
            "weights": [[i, name, _layout(replay.args[i])] for i, name in replay.weights.items()],
            "dynamic": [[i, path if isinstance(path, str) else list(path), list(shape), list(stride)]
                        for path, (i, shape, stride) in zip(replay.paths, replay.dynamic)],
            "records": records}


def load(aot_key: str):
    """The graph the AOT autograd cache holds under `aot_key`, callable as f(*inputs); raises where
    the entry is not there."""
    from torch._inductor.standalone_compile import CacheCompiledArtifact

    return CacheCompiledArtifact._load_impl(contextlib.nullcontext(), aot_key)


def import_ahead() -> None:
    """The modules a load imports, imported now (start-up) rather than at the first load."""
    importlib.import_module("torch._inductor.standalone_compile")
    importlib.import_module("torch._functorch._aot_autograd.autograd_cache")


def load_replay(model, info: dict) -> Replay | None:
    """The Replay of a shape the child compiled (`shape_info`), its graph loaded from the cache; None
    where the model's weights are not laid out as they were there, or the graph cannot be loaded."""
    weights = named_weights(model)
    args: list = [None] * info["args"]
    for i, name, layout in info["weights"]:
        t = weights.get(name)
        if t is None or _layout(t) != layout:
            return None
        args[i] = t
    try:
        records = {layer: (_record_type(module, name), tuple(fields))
                   for layer, module, name, fields in info["records"] or ()} or None
        fn = load(info["aot"])
    except Exception:  # noqa: BLE001 - gone from the cache, another torch's entry, a foreign note: traced instead
        return None
    paths = [p if isinstance(p, str) else tuple(p) for _, p, _, _ in info["dynamic"]]
    dynamic = [(i, tuple(shape), tuple(stride)) for i, _, shape, stride in info["dynamic"]]
    return Replay(fn, args, paths, dynamic, model, {i: name for i, name, _ in info["weights"]}, records)


def _record_type(module: str, name: str):
    if not module.startswith("clover."):
        raise ValueError(f"not a record type of clover's: {module}.{name}")
    return getattr(importlib.import_module(module), name)
