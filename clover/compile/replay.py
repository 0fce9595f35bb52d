"""A compiled graph called without dynamo (no frame evaluation, no guards)."""

from __future__ import annotations

import operator
import weakref

from .shapes import layout_of


class Replay:
    """One compiled graph called directly: the graph's inputs are the model's weights (bound once)
    and the call's tensors, fetched from (ids, pad, cache) by the paths found at capture time and
    checked against the captured shapes and strides (a mismatch returns None: the caller goes
    through dynamo instead). Built only where the compiling call returned nothing but the logits and,
    in a recorded forward (`cache.recording`), the tensors its layers recorded on the cache: the
    Replay stores those as dynamo's bytecode would (`records`), so skipping it changes nothing.
    Weights are bound by object: in-place updates are seen; where the model's modules, parameters or
    buffers were replaced (`Bindings`), a replaced weight laid out like the bound one is rebound and
    any other change retires the Replay (dynamo takes over)."""

    def __init__(self, fn, args: list, paths: list, dynamic: list, model, weights: dict, records: dict | None = None):
        self.fn, self.args, self.paths, self.dynamic = fn, args, paths, dynamic  # paths: "ids", "pad" or a cache path
        self.model, self.weights = weakref.ref(model), weights  # weights: graph input slot -> parameter name
        self.records = records  # layer -> (type, graph output index or None per field), or None
        self.bindings = Bindings(model)

    @classmethod
    def build(cls, record, model, result, ids, pad, cache) -> "Replay | None":
        outputs = record.pop("outputs", None)
        if outputs is None or not outputs or outputs[0] is not result:
            return None
        records = record_outputs(cache.recorded, outputs) if cache.recording else {}
        if records is None:
            return None
        used = sum(i is not None for _, fields in records.values() for i in fields)
        if len(outputs) != 1 + used:  # any other output is a side effect we'd skip
            return None
        sources = {id(ids): "ids", **({id(pad): "pad"} if pad is not None else {})}
        sources.update({id(t): path for path, t in cache.tensors().items()})
        names = {id(t): n for n, t in named_weights(model).items()}
        args, paths, dynamic, weights = list(record["inputs"]), [], [], {}
        for i, t in enumerate(args):
            if id(t) in sources:
                dynamic.append((i, tuple(t.shape), t.stride()))
                paths.append(sources[id(t)])
                args[i] = None  # fetched per call; holding it would pin this call's tensors
            elif id(t) in names:
                weights[i] = names[id(t)]
            else:
                return None  # an input we cannot fetch again
        return cls(record["fn"], args, paths, dynamic, model, weights, records or None)

    def current(self) -> bool:
        """Whether the bound weights are the model's: a replaced one laid out like the bound one is
        rebound, any other change retires the Replay."""
        if self.bindings.unchanged():
            return True
        model = self.model()
        now = named_weights(model) if model is not None else {}
        for i, name in self.weights.items():
            old, new = self.args[i], now.get(name)
            if new is None or layout_of(new) != layout_of(old):
                return False
            self.args[i] = new
        self.bindings = Bindings(model)
        return True

    def fetch(self, ids, pad, cache) -> list:
        return [ids if p == "ids" else pad if p == "pad" else cache.get(p) for p in self.paths]

    def __call__(self, ids, pad, cache, before=None):
        """The graph's logits, or None where this call does not fit it; `before()` runs right before
        the graph does (not where it does not)."""
        if not self.current():
            return None
        args = list(self.args)
        for (i, shape, stride), t in zip(self.dynamic, self.fetch(ids, pad, cache)):
            if t.shape != shape or t.stride() != stride:
                return None
            args[i] = t
        if before is not None:
            before()
        out = self.fn(*args)
        if self.records:  # a recorded forward: its records, as its layers' `cache.record` stored them
            for layer, (kind, fields) in self.records.items():
                cache.recorded[layer] = kind(*(out[i] if i is not None else None for i in fields))
        return out[0]  # the logits (build)


def record_outputs(recorded: dict, outputs) -> dict | None:
    """Where each field of each record a recorded forward stored on the cache sits among the graph's
    outputs: {layer: (record type, index or None per field)} (None: the field is None); None where
    a recorded tensor is not one of the outputs (a view the call made outside the graph)."""
    index = {id(t): i for i, t in enumerate(outputs)}
    found = {}
    for layer, rec in recorded.items():
        fields = tuple(None if t is None else index.get(id(t), -1) for t in rec)
        if -1 in fields or 0 in fields:
            return None
        found[layer] = (type(rec), fields)
    return found


class Bindings:
    """The objects a model's modules hold (submodules, parameters, buffers) at one moment, checked
    by identity: any of them replaced since shows as changed (held, so no id is reused)."""

    def __init__(self, model):
        self.stores, self.names, self.objects = [], [], []
        for m in model.modules() if model is not None else ():
            for store in (m._modules, m._parameters, m._buffers):
                for name, obj in store.items():
                    self.stores.append(store)
                    self.names.append(name)
                    self.objects.append(obj)

    def unchanged(self) -> bool:
        # checked before every graph call: one pass in C (no Python frame per slot)
        return all(map(operator.is_, map(dict.get, self.stores, self.names), self.objects))


def named_weights(model) -> dict:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}
