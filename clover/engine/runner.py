"""The model runner: the only code that calls the model. Decoding modes and the server hand it
(ids, cache rows, layout arguments, which logits) and get logits back, so a compiled runner or
another back end plugs in without touching them.

* `EagerRunner`: the model's forward, op by op (the reference; the default).
* `CompiledRunner`: the steady steps (an AR token, a draft window, a window plus the block it
  commits) as one `torch.compile` graph each (inductor; on CUDA `mode="reduce-overhead"`, CUDA
  graphs). Shapes are static: the attention layers read the cache's whole capacity (masked past each
  row's length), capacities come in buckets, the MoE routing is traced into the graph as a gather
  of the chosen experts' weights + bmm where tokens x top_k < experts (an AR step) and runs as one
  opaque custom op otherwise, the cache commit needs no `nonzero`. A graph is compiled once per shape (rows, window width, clean
  columns, capacity bucket) and replayed after; prefill (arbitrary widths) runs eagerly. Logits
  equal the eager runner's within float rounding (fp32: 1e-5); tests/test_runner_compiled.py checks
  it in every mode.
"""

from __future__ import annotations

import weakref

import torch

RUNNERS = ("eager", "compiled")
CAPACITY_BUCKET = 256  # compiled caches hold a multiple of this many tokens per row
RECOMPILE_LIMIT = 64  # graphs per process for the step function (shape buckets x variants)


class EagerRunner:
    """The model's own forward; `forward` returns the logits the caller asked for."""

    name = "eager"

    def __init__(self, model):
        self.model = model

    def new_cache(self, rows: int, capacity: int):
        return self.model.new_cache(rows, capacity=capacity)

    def forward(self, ids, cache, *, block_size=None, draft_len=0, clean_block_size=None, pad=None, keep=0,
                index=None) -> torch.Tensor:
        """ids [rows, L] = [clean segment ; draft window of `draft_len`]; `keep`/`index` choose the
        columns whose logits are computed (see CloverForBlockDiffusion.forward)."""
        return self.model(ids, cache=cache, block_size=block_size, draft_len=draft_len,
                          clean_block_size=clean_block_size, pad_mask=pad, logits_to_keep=keep,
                          logits_index=index).logits


def _step(model, ids, layout, cache, keep: int):
    return model.head(model.model(ids, layout, cache), keep)


_compiled_steps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiled_step(model):
    """One compiled step function per model (its graphs are reused by every engine on it)."""
    fn = _compiled_steps.get(model)
    if fn is None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        mode = "reduce-overhead" if model.device.type == "cuda" else None
        fn = torch.compile(_step, dynamic=False, fullgraph=True, mode=mode)
        _compiled_steps[model] = fn
    return fn


def is_steady(num_clean: int, length: int) -> bool:
    """Shapes a steady decode repeats (compiled): no clean column or one (AR), or a clean block of a
    power-of-two size up to 64, with a window of at most 64. Anything else (prefill chunks, a prompt's
    tail fused with the first window) would compile a graph used once: it runs eagerly."""
    return num_clean <= 64 and length - num_clean <= 64 and num_clean & (num_clean - 1) == 0


class CompiledRunner(EagerRunner):
    name = "compiled"

    def __init__(self, model, skip_guards: bool = False):
        super().__init__(model)
        self.step_fn = compiled_step(model)
        self.compiled_calls = self.eager_calls = 0
        # skip_guards: once a shape has been compiled, replay it with dynamo evaluating only the guards
        # that tell its compiled entries apart (torch.compiler.set_stance(skip_guard_eval_unsafe=True)).
        # Safe here because `_shape_key` names everything the entries differ by, so a call reaches
        # the unsafe path only when an entry compiled for exactly its key exists.
        self.skip_guards = skip_guards
        self._seen = _seen_keys.setdefault(model, set())

    def new_cache(self, rows: int, capacity: int):
        return super().new_cache(rows, -(-capacity // CAPACITY_BUCKET) * CAPACITY_BUCKET)

    def forward(self, ids, cache, *, block_size=None, draft_len=0, clean_block_size=None, pad=None, keep=0,
                index=None) -> torch.Tensor:
        num_clean = ids.shape[1] - draft_len
        if cache is None or not is_steady(num_clean, ids.shape[1]):
            self.eager_calls += 1
            return super().forward(ids, cache, block_size=block_size, draft_len=draft_len,
                                   clean_block_size=clean_block_size, pad=pad, keep=keep, index=index)
        self.compiled_calls += 1
        m = self.model
        layout = m.prepare_stream(ids, cache, block_size, draft_len, clean_block_size, pad, static=True)
        key = _shape_key(ids, layout, cache, keep)
        if self.skip_guards and key in self._seen:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                logits = self.step_fn(m, ids, layout, cache, keep)
        else:
            logits = self.step_fn(m, ids, layout, cache, keep)
            self._seen.add(key)
        m.commit_lens(cache, num_clean, pad)
        return logits if index is None else logits[:, index]


_seen_keys: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> compiled shape keys


def _shape_key(ids, layout, cache, keep) -> tuple:
    """Everything a compiled step specialises on besides the (fixed) weights."""
    return (tuple(ids.shape), ids.device, layout.num_clean, layout.clean_block_size, layout.prefix,
            layout.pad is None, layout.calib is None, None if layout.calib is None else tuple(layout.calib.shape),
            cache.recording, cache.capacity, cache.batch_size, cache.dtype, keep,
            torch.is_grad_enabled(), torch.is_inference_mode_enabled())


def make_runner(kind: str, model) -> EagerRunner:
    if kind == "eager":
        return EagerRunner(model)
    if kind == "compiled":
        return CompiledRunner(model)
    raise ValueError(f"unknown runner {kind!r} (known: {', '.join(RUNNERS)})")
