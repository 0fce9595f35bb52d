"""The model runner: the only code that calls the model. Decoding modes and the server hand it
(ids, cache rows, layout arguments, which logits) and get logits back, so a compiled runner or
another back end plugs in without touching them.

* `EagerRunner`: the model's forward, op by op (the reference; the default).
* `CompiledRunner`: the steady steps as compiled graphs, replayed (clover/compile: shapes,
  buckets, Replay, the per-model CompileState). Logits equal the eager runner's within float
  rounding (fp32: 1e-5); tests/test_runner_compiled.py checks it in every mode.

Besides the model, a mode may hand the runner a pure tensor function it calls every step (`fuse`:
a diffusion step's fill policy and block bookkeeping; the distribution scores of entropy /
margin). The eager runner calls it as it is; the compiled runner makes it one graph per input
layout (`compile.Fused`).
"""

from __future__ import annotations

import torch

from ..compile import Fused, state_of
from ..compile.shapes import CAPACITY_BUCKET, STEADY_MAX, attention_span, bucket, bucket_width, dense, is_steady, pad_rows, shape_key

RUNNERS = ("eager", "compiled")


class EagerRunner:
    """The model's own forward; `forward` returns the logits the caller asked for."""

    name = "eager"
    prefill_chunk = None  # no cap on the prompt tokens per prefill forward
    # whether the head costs the same for a subset of the kept columns (`logits_index`) as for all of them:
    # then a caller needs not work out which columns it wants
    full_head = False

    def __init__(self, model):
        self.model = model

    def new_cache(self, rows: int, capacity: int):
        return self.model.new_cache(rows, capacity=capacity)

    def fuse(self, fn, key, shared=()):
        """`fn(*tensors) -> tuple of tensors`, pure (no side effect, no host sync, output shapes
        fixed by the input shapes), row by row: every input but those at the positions `shared` (the
        banned ids, ...) and every output have the rows as their first dimension and no row's outputs
        depend on another row's inputs. As this runner calls it: eagerly, op by op."""
        return fn

    def forward(self, ids, cache, *, block_size=None, draft_len=0, clean_block_size=None, pad_mask=None,
                logits_to_keep=0, logits_index=None, **asked) -> torch.Tensor:
        """ids [rows, L] = [clean segment ; draft window of `draft_len`]; `logits_to_keep` /
        `logits_index` choose the columns whose logits are computed (see CloverForBlockDiffusion.forward);
        `asked` (`sub_block_head=True`: engine/batch.Forward) goes to the model as it is."""
        return self.model(ids, cache=cache, block_size=block_size, draft_len=draft_len,
                          clean_block_size=clean_block_size, pad_mask=pad_mask, logits_to_keep=logits_to_keep,
                          logits_index=logits_index, **asked).logits


class CompiledRunner(EagerRunner):
    """Steady calls through the model's compiled graphs; the others, and shapes no graph may be made
    for (deferred, or past dynamo's recompile limit), eagerly.

    `replay`: once a shape is compiled, call its graph directly (`Replay`) instead of through
    dynamo's guard evaluation (False keeps every call on dynamo). `defer`: a shape (or fused-function
    layout) with no graph yet runs eagerly and waits for `compile_deferred` (a server calls it when
    idle: no request waits on a compile mid-step). `c_shims`: see compile.CompileState (read when
    the model's state is first made)."""

    name = "compiled"
    prefill_chunk = STEADY_MAX  # prompts are committed in chunks a graph takes (the engine's cap)
    full_head = True  # a graph runs the head on every kept column (one shape); `logits_index` only slices its logits

    def __init__(self, model, replay: bool = True, defer: bool = False, c_shims: bool | None = None):
        super().__init__(model)
        self.state = state_of(model, c_shims)
        self.compiled_calls = self.eager_calls = self.replayed_calls = 0
        self.replay, self.defer = replay, defer

    def new_cache(self, rows: int, capacity: int):
        return super().new_cache(rows, -(-capacity // CAPACITY_BUCKET) * CAPACITY_BUCKET)

    def fuse(self, fn, key, shared=()):
        """`fn` compiled once per input layout, graphs shared by every runner on the model under
        `key` (hashable: it must name everything `fn` computes with besides its tensor inputs); rows in
        buckets, as the model's steps (`Fused`)."""
        return Fused(fn, key, self.state, shared, defer=self.defer)

    def forward(self, ids, cache, *, block_size=None, draft_len=0, clean_block_size=None, pad_mask=None,
                logits_to_keep=0, logits_index=None, **asked) -> torch.Tensor:
        call = dict(block_size=block_size, draft_len=draft_len, clean_block_size=clean_block_size, pad_mask=pad_mask,
                    logits_to_keep=logits_to_keep, logits_index=logits_index, **asked)
        num_clean = ids.shape[1] - draft_len
        ids, pad = dense(ids), dense(pad_mask)
        steady = cache is not None and is_steady(num_clean, ids.shape[1])
        given = ids  # bucket pads `ids`; the eager fallbacks run the call as given
        if cache is not None and not steady and (padded := bucket(ids, pad, num_clean)) is not None:
            (ids, pad, num_clean), steady = padded, True
        if not steady:
            return self._eager(given, cache, call)
        clean_block_size, block = self.model.check_stream(ids, cache, block_size, draft_len, clean_block_size, static=True)
        rows = ids.shape[0]
        run_ids, run_pad, run_cache = pad_rows(ids, pad, cache, bucket_width(rows))
        span = attention_span(run_cache.max_len() + run_ids.shape[1], run_cache.capacity) \
            if getattr(self.model, "span_limited", False) else 0  # graphs reading only the slots in use
        key = shape_key(run_ids, run_pad, run_cache, logits_to_keep, draft_len, clean_block_size, block, span,
                        bool(asked.get("sub_block_head")))
        logits, replayed = self.state.call(key, run_ids, run_pad, run_cache, replay=self.replay, defer=self.defer)
        if logits is None:
            return self._eager(given, cache, call)
        self.compiled_calls += 1
        self.replayed_calls += replayed
        if run_cache is not cache:
            logits = logits[:rows]
            if cache.recording:  # the spare rows' records go: rollback rewinds the real rows
                cache.trim_records(rows)
        self.model.commit_lens(cache, num_clean, pad)
        return logits if logits_index is None else logits[:, logits_index]

    def _eager(self, ids, cache, call: dict) -> torch.Tensor:
        self.eager_calls += 1
        return super().forward(ids, cache, **call)


def deferred(model) -> int:
    """How many shapes of `model` (and fused-function layouts) wait for `compile_deferred`."""
    return state_of(model).waiting()


def before_next_graph(model, fn) -> None:
    """`fn()` runs once, in this thread, right before its next compiled graph call of `model`, where the
    thread lets go of the GIL for the graph's whole run (`CompileState.before_next_graph`)."""
    state_of(model).before_next_graph(fn)


def compile_deferred(model) -> bool:
    """Compile one graph that a deferring runner (`CompiledRunner(defer=True)`) of `model` ran eagerly
    (a fused-function layout first, then the oldest model shape); False when none waits."""
    return state_of(model).compile_next()


def make_runner(kind: str, model, defer: bool = False) -> EagerRunner:
    """`defer` (compiled): new shapes run eagerly until `compile_deferred` compiles them (a server)."""
    if kind == "eager":
        return EagerRunner(model)
    if kind == "compiled":
        return CompiledRunner(model, defer=defer)
    raise ValueError(f"unknown runner {kind!r} (known: {', '.join(RUNNERS)})")
