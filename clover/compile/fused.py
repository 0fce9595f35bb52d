"""A pure tensor function as one compiled graph per input layout (a decoding mode's step
bookkeeping), called directly."""

from __future__ import annotations

import torch

from .shapes import bucket_width, layout_of


class Fused:
    """A pure tensor function traced (make_fx, fake tensors) and compiled (inductor) once per input
    layout, then called directly: no dynamo frame, no guards. Its inputs are all tensors, so the
    layouts are the whole key; its Python constants are the caller's `key`. Its per-row inputs (all
    but the positions `shared`) come with spare zero rows up to a `bucket_width`, as the model's
    steps do (`pad_rows`), and the outputs' spare rows are dropped. Graphs live in `state` (a
    `CompileState`), shared by every Fused of the same key there."""

    def __init__(self, fn, key, state, shared=(), defer: bool = False):
        self.fn, self.key, self.state = fn, key, state
        self.shared = frozenset(shared)
        self.defer = defer  # a layout with no graph yet runs eagerly and waits for `compile_deferred`

    def __call__(self, *args):
        graph = self.state.fused_graphs.get(self._key(args))
        if graph is not None:  # the layouts of a checked call whose rows were a bucket: the graph as it is
            return tuple(graph(*args))
        rows = next(a.shape[0] for i, a in enumerate(args) if i not in self.shared)
        if any(a.dim() == 0 or a.shape[0] != rows for i, a in enumerate(args) if i not in self.shared):
            raise ValueError(f"Fused {self.key!r}: the inputs not in shared={sorted(self.shared)} must all have "
                             f"{rows} rows, got shapes {[tuple(a.shape) for a in args]}")
        spare = bucket_width(rows) - rows
        if spare:
            args = [a if i in self.shared else a.new_zeros((rows + spare, *a.shape[1:])).index_copy_(
                0, torch.arange(rows, device=a.device), a) for i, a in enumerate(args)]
            return tuple(t[:rows] for t in self._call(*args))
        return self._call(*args)

    def _key(self, args) -> tuple:
        return self.key, tuple(layout_of(a) for a in args), torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def _call(self, *args):
        k = self._key(args)
        graph = self.state.fused_graphs.get(k)
        if graph is None:
            if self.defer:
                self.state.fused_deferred[k] = self
                return tuple(self.fn(*args))
            graph = self._compile(k, args)
        return tuple(graph(*args))

    def compile(self, k) -> None:
        """Compile the graph of a key `_call` deferred, on zeros of its input layouts."""
        if k not in self.state.fused_graphs:
            _, layouts, grad, inference = k
            args = [torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
                    for shape, stride, dtype, device in layouts]
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                self._compile(k, args)

    def _compile(self, k, args):
        from torch._inductor.compile_fx import compile_fx
        from torch.fx.experimental.proxy_tensor import make_fx

        gm = make_fx(self.fn, tracing_mode="fake")(*args)
        with torch._inductor.config.patch(cpp_wrapper=args[0].device.type == "cpu"):
            graph = self.state.fused_graphs[k] = compile_fx(gm, list(args))
        self.state.fused_compiles += 1
        return graph
