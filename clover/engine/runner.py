"""The model runner: the only code that calls the model. Decoding modes and the server hand it
(ids, cache rows, layout arguments, which logits) and get logits back, so a compiled runner or
another back end plugs in without touching them.

* `EagerRunner`: the model's forward, op by op (the reference; the default).
* `CompiledRunner`: the steady steps (an AR token, a draft window, a window plus the block it
  commits), layout included, as one `torch.compile` graph each (inductor; on CUDA
  `mode="reduce-overhead"`, CUDA graphs). Shapes are static: the attention layers write the step's
  K/V into the cache in place and read its whole capacity (masked past each row's length),
  capacities come in buckets, the MoE routing is traced into the graph as a gather of the chosen
  experts' weights + bmm up to 128 (token, expert) pairs (modeling_clover.GATHER_PAIRS: AR steps
  and forwards of up to 64 tokens at top-2) and runs as one opaque custom op beyond, the cache commit needs no `nonzero`.
  On a CPU the graph's kernels are called by inductor's C++ wrapper and its fp32 linears run on
  weights packed once (`route_ops`: `route_linears`, ops/linear/tiled.py) and its chunk solves on a small
  forward substitution (`route_solves`). A graph is compiled once per shape (rows,
  window width, clean columns, capacity bucket) and replayed after: on a CPU by calling the
  captured graph directly (`Replay`: no dynamo guard evaluation, which cost ~0.4 ms a step);
  prefill runs in chunks of at most 64 tokens less the window, each left-padded to a bucket (masked columns; `bucket`),
  so it replays graphs too. Logits equal the eager runner's within float rounding (fp32: 1e-5);
  tests/test_runner_compiled.py checks it in every mode.

Besides the model, a mode may hand the runner a pure tensor function it calls every step (`fuse`:
a diffusion step's fill policy and block bookkeeping, ~25 small ops; the distribution scores of
entropy / margin). The eager runner calls it as it is; the compiled runner traces it once per input
layout (make_fx) and calls the inductor graph directly: one call instead of per-op dispatch.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch

from ..models.cache_clover import CloverCache
from ..models.modeling_clover import CloverExperts, stream_layout
from ..ops.linear import bf16_panels, solve_fits, tiled, worth_routing

RUNNERS = ("eager", "compiled")
CAPACITY_BUCKET = 256  # compiled caches hold a multiple of this many tokens per row
# graphs per process for the step function (shape buckets x variants): `clover tune`'s default grid on all held-out
# prompts needs ~80 (ar and 4 block sizes: prefill chunks, prompt tails and steady steps each); past it, eager
RECOMPILE_LIMIT = 256
CPP_WRAPPER = True  # inductor's C++ wrapper calls a graph's kernels (no Python between them: ~0.2 ms a step)
PACK_LINEARS = True  # CPU graphs: fp32 linears run on packed weights (ops/linear/tiled.py)


class EagerRunner:
    """The model's own forward; `forward` returns the logits the caller asked for."""

    name = "eager"
    prefill_chunk = None  # no cap on the prompt tokens per prefill forward
    # whether the head costs the same for a subset of the kept columns (`index`) as for all of them:
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

    def forward(self, ids, cache, *, block_size=None, draft_len=0, clean_block_size=None, pad=None, keep=0,
                index=None) -> torch.Tensor:
        """ids [rows, L] = [clean segment ; draft window of `draft_len`]; `keep`/`index` choose the
        columns whose logits are computed (see CloverForBlockDiffusion.forward)."""
        return self.model(ids, cache=cache, block_size=block_size, draft_len=draft_len,
                          clean_block_size=clean_block_size, pad_mask=pad, logits_to_keep=keep,
                          logits_index=index).logits


def _step(model, ids, pad, cache, keep: int, draft_len: int, clean_bs: int, block: int):
    """One steady step, layout included: its masks and positions are a dozen small ops on the
    cache's lengths (~0.4 ms a step when run eagerly on the host), fused into the graph here."""
    layout = stream_layout(model.config, ids.shape[0], ids.shape[1], draft_len, clean_bs, block, cache, pad,
                           ids.device, static=True)
    return model.head(model.model(ids, layout, cache, keep), keep)


_compiled_steps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (step fn, captures)


_limits = threading.local()  # `raised`: this thread raised dynamo's recompile limits


def raise_recompile_limits() -> None:
    """dynamo's recompile limits up to RECOMPILE_LIMIT, once per thread: its config is per thread, so a
    limit raised in the thread that made a step left the default (8 graphs of `_step`, over every
    model) to another thread that compiles, e.g. a server's scheduler compiling deferred shapes. Once:
    a lower limit set afterwards (a test's patch) stays."""
    if not getattr(_limits, "raised", False):
        for limit in ("recompile_limit", "accumulated_recompile_limit"):  # per code object, and over all of them
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), RECOMPILE_LIMIT))
        _limits.raised = True


def compiled_step(model):
    """One compiled step function per model (its graphs are reused by every engine on it), and the
    list its backend appends each newly compiled graph to (CPU: see `Replay`)."""
    entry = _compiled_steps.get(model)
    if entry is None:
        raise_recompile_limits()
        captures: list = []
        if model.device.type == "cuda":  # CUDA graphs replay there; dynamo's call stays in front of them
            fn = torch.compile(_step, dynamic=False, fullgraph=True, mode="reduce-overhead")
        else:
            tiled.available()  # build (or load) the C++ kernels before tracing: graphs then route to them
            for m in model.modules():  # bf16 panels (half the bytes): tiled beats gathered from an AR step's 2 pairs
                if isinstance(m, CloverExperts) and bf16_panels(m.gate_up_proj) and bf16_panels(m.down_proj):
                    m.tiled_pairs = 1
            fn = torch.compile(_step, dynamic=False, fullgraph=True, backend=_capturing_backend(captures, C_SHIMS))
        entry = _compiled_steps[model] = (fn, captures)
    return entry


def _capturing_backend(captures: list, c_shims: bool):
    """Inductor (what backend="inductor" runs at the default mode), remembering each graph it compiles
    with the real inputs of the call that compiled it and that call's outputs; `c_shims`: the graphs
    call the clover_cpu ops' C entry points (C_SHIMS as the model's step was first made)."""

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        if PACK_LINEARS:
            route_ops(gm)
        with torch._inductor.config.patch(cpp_wrapper=CPP_WRAPPER, **(_c_shim_config() if c_shims else {})):
            compiled = compile_fx(gm, example_inputs)
        record = {"fn": compiled, "inputs": list(example_inputs)}
        captures.append(record)

        def run(*args):
            out = compiled(*args)
            if "outputs" not in record:  # the compiling call: kept until the runner builds its Replay
                record["outputs"] = out
            return out

        return run

    return backend


# with the C++ wrapper, a graph calls the clover_cpu ops' C entry points directly (tiled.c_shims), not
# through the dispatcher; read when a model's compiled step is made (bench/step.py's compiled-dispatcher: False)
C_SHIMS = True


def _c_shim_config() -> dict:
    """The inductor config that makes a C++-wrapper graph call the ops' C entry points."""
    return {"aot_inductor.custom_ops_to_c_shims": tiled.c_shims()} if CPP_WRAPPER else {}


def route_linears(gm) -> int:
    """Send the graph's fp32 CPU linears to `clover_cpu::linear` (ops/linear/tiled.py: a weight packed
    once, read once per call); the weight must be a graph input (a parameter), whose packed copy is
    then made once. Returns how many were routed."""
    routed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (torch._C._nn.linear, torch.nn.functional.linear):
            continue
        args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
        if not (isinstance(args[0], torch.fx.Node) and isinstance(args[1], torch.fx.Node) and args[1].op == "placeholder"):
            continue
        x, w = args[0].meta.get("example_value"), args[1].meta.get("example_value")
        if (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.device == w.device
                and x.dtype == w.dtype and worth_routing(w)):
            node.target, node.args, node.kwargs = torch.ops.clover_cpu.linear.default, tuple(args[:3]), {}
            routed += 1
    if routed:
        gm.recompile()
    return routed


def route_solves(gm) -> int:
    """Send the graph's fp32 CPU unit lower-triangular solves (the gated delta rule's chunk systems)
    to `clover_cpu::unit_lower_solve` (ops/gated_delta_rule/unit_lower_solve.cpp). Returns how many
    were routed."""
    routed = 0
    for node in gm.graph.nodes:
        if (node.op != "call_function" or node.target is not torch.linalg.solve_triangular or len(node.args) != 2
                or not all(isinstance(n, torch.fx.Node) for n in node.args)):
            continue
        kw = node.kwargs
        a, b = (n.meta.get("example_value") for n in node.args)
        if (set(kw) <= {"upper", "unitriangular", "left"} and kw.get("upper") is False
                and kw.get("unitriangular") is True and kw.get("left", True) is True and solve_fits(a, b)):
            node.target, node.kwargs = torch.ops.clover_cpu.unit_lower_solve.default, {}
            routed += 1
    if routed:
        gm.recompile()
    return routed


def route_ops(gm) -> int:
    """A CPU graph's ops that have a clover_cpu kernel sent to it: linears, then chunk solves."""
    return route_linears(gm) + route_solves(gm)


_weights_epoch = [0]  # bumped whenever any module (re)registers a parameter, buffer or submodule


def _bump_weights_epoch(*_):
    _weights_epoch[0] += 1


for _register in (torch.nn.modules.module.register_module_parameter_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook,
                  torch.nn.modules.module.register_module_module_registration_hook):
    _register(_bump_weights_epoch)


class Replay:
    """One compiled graph called without dynamo (no frame evaluation, no guards): the graph's inputs
    are the model's parameters (bound once) and the call's tensors, fetched from (ids, pad, cache)
    by the attribute paths found at capture time and checked against the captured shapes and strides
    (a mismatch returns None: the caller goes through dynamo instead). Built only where the compiling
    call returned nothing but the logits (no side effect outside the graph), so skipping dynamo's
    bytecode changes nothing.
    Weights are bound by object: in-place updates are seen; after any module registered a parameter,
    buffer or submodule (`_weights_epoch`), the bound objects are checked once against the model's
    and a replaced one is rebound (or, laid out otherwise, retires the Replay: dynamo takes over)."""

    def __init__(self, fn, args: list, fetch, dynamic: list, model, weights: dict):
        self.fn, self.args, self.fetch, self.dynamic = fn, args, fetch, dynamic
        self.model, self.weights, self.epoch = weakref.ref(model), weights, _weights_epoch[0]  # weights: slot -> name

    @classmethod
    def build(cls, record, model, result, ids, pad, cache) -> "Replay | None":
        outputs = record.pop("outputs", None)
        if outputs is None or cache.recording:  # recording stores tensors on the cache: a side effect
            return None
        if len(outputs) != 1 or outputs[0] is not result:  # any other output is a side effect we'd skip
            return None
        paths = {id(ids): "ids", **({id(pad): "pad"} if pad is not None else {})}
        for name, v in vars(cache).items():
            if isinstance(v, torch.Tensor):
                paths[id(v)] = f"cache.{name}"
            elif isinstance(v, (dict, list)):
                for k, t in (v.items() if isinstance(v, dict) else enumerate(v)):
                    if isinstance(t, torch.Tensor) and isinstance(k, (int, str)):
                        paths[id(t)] = f"cache.{name}[{k!r}]"
        names = {id(t): n for n, t in _named_weights(model).items()}
        args, dynamic, exprs, weights = list(record["inputs"]), [], [], {}
        for i, t in enumerate(args):
            if id(t) in paths:
                dynamic.append((i, tuple(t.shape), t.stride()))
                exprs.append(paths[id(t)])
                args[i] = None  # fetched per call; holding it would pin this call's tensors
            elif id(t) in names:
                weights[i] = names[id(t)]
            else:
                return None  # an input we cannot fetch again
        fetch = eval(f"lambda ids, pad, cache: ({', '.join(exprs)},)")  # noqa: S307 (paths built above)
        return cls(record["fn"], args, fetch, dynamic, model, weights)

    def current(self) -> bool:
        """Whether the bound weights are the model's (checked once per `_weights_epoch`): a replaced
        one laid out like the captured one is rebound, any other change retires the Replay."""
        if self.epoch != _weights_epoch[0]:
            model = self.model()
            now = _named_weights(model) if model is not None else {}
            for i, name in self.weights.items():
                old, new = self.args[i], now.get(name)
                if new is None or _layout_of(new) != _layout_of(old):
                    return False
                self.args[i] = new
            self.epoch = _weights_epoch[0]
        return True

    def __call__(self, ids, pad, cache):
        if not self.current():
            return None
        args = list(self.args)
        for (i, shape, stride), t in zip(self.dynamic, self.fetch(ids, pad, cache)):
            if t.shape != shape or t.stride() != stride:
                return None
            args[i] = t
        return self.fn(*args)[0]  # the graph's only output (build): the logits


def _layout_of(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _named_weights(model) -> dict:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


STEADY_MAX = 64  # widest clean segment and window a compiled graph takes (also the compiled prefill chunk)


def is_steady(num_clean: int, length: int) -> bool:
    """Shapes a steady decode repeats (compiled): no clean column or one (AR), or a clean block of a
    power-of-two size up to 64, with a window of at most 64. Other clean widths up to 64 (prefill
    chunks, a prompt's tail fused with the first window) are left-padded to a bucket (`bucket`);
    wider ones run eagerly."""
    return num_clean <= STEADY_MAX and length - num_clean <= STEADY_MAX and num_clean & (num_clean - 1) == 0


def bucket_width(n: int) -> int:
    """The columns a compiled graph is made for, for a call of n: powers of two up to 16, then multiples
    of 8. A step's cost grows with its rows in steps (a CPU's AMX tiles hold 16; from the task prompts'
    decode, bench/decode_breakdown.py: 13-16 columns ~1.7 ms, 20 ~2.5, 32 ~2.7, 36 ~3.7), so padding
    17-24 columns to 32 or 33-48 to 64, as powers of two did, paid for rows nobody asked for."""
    return _next_pow2(n) if n <= 16 else -(-n // 8) * 8


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def bucket(ids, pad, num_clean: int):
    """(ids, pad, num_clean) of a call that is not steady, with the clean segment left-padded so the
    call's columns are a `bucket_width`, or to the next power of two (steady), whichever is narrower
    (a clean segment of at most 64 columns): padded columns are masked like
    a shorter row's in a batch (the model's pad_mask), so the logits of the real columns are those of
    the unpadded call; None where even the padded shape is not steady (it stays eager)."""
    window = ids.shape[1] - num_clean
    widths = [w for w in (bucket_width(ids.shape[1]) - window, _next_pow2(num_clean)) if w <= STEADY_MAX]
    if not widths or window > STEADY_MAX:
        return None
    width = min(widths)
    extra = width - num_clean
    pad = pad if pad is not None else torch.zeros_like(ids, dtype=torch.bool)
    return (torch.nn.functional.pad(ids, (extra, 0)), torch.nn.functional.pad(pad, (extra, 0), value=True), width)


def pad_rows(ids, pad, cache, rows: int):
    """(ids, pad, cache) of a call of fewer rows than its graph's (`rows`, a `bucket_width`: a server's
    batch of 3, 5, 6 or 7 rows replays the graph of 4 or 8 instead of compiling its own), with spare
    rows after the real ones: token 0, no padding, a cache row of their own. The cache's tensors are
    re-homed once (after rows joined, left or the capacity grew) as the first rows of tensors of `rows`
    rows, so the real rows are views the graph writes in place; the spare rows start each call from
    length 0 and whatever they hold is never read by a real row (rows never mix), and their logits and
    lengths are dropped. Unchanged when the call has `rows` rows already."""
    real = ids.shape[0]
    if real == rows:
        return ids, pad, cache
    spare = rows - real
    ids = torch.nn.functional.pad(ids, (0, 0, 0, spare))
    pad = torch.nn.functional.pad(pad, (0, 0, 0, spare)) if pad is not None else None
    return ids, pad, cache.pad_rows(rows)


class CompiledRunner(EagerRunner):
    name = "compiled"
    prefill_chunk = STEADY_MAX  # prompts are committed in chunks a graph takes (the engine's cap)
    full_head = True  # a graph runs the head on every kept column (one shape); `index` only slices its logits

    def __init__(self, model, replay: bool = True, defer: bool = False):
        super().__init__(model)
        self.step_fn, self._captures = compiled_step(model)
        self.compiled_calls = self.eager_calls = self.replayed_calls = 0
        # replay: once a shape is compiled, call its graph directly (`Replay`) instead of through
        # dynamo's guard evaluation (~0.4 ms a call on a CPU); False keeps every call on dynamo
        self.replay = replay
        # defer: a shape (or fused-function layout) with no graph yet runs eagerly and waits in a queue
        # for `compile_deferred` (a server calls it when idle: no request ever waits on a compile mid-step)
        self.defer = defer
        self._replays = _replays.setdefault(model, {})

    def new_cache(self, rows: int, capacity: int):
        return super().new_cache(rows, -(-capacity // CAPACITY_BUCKET) * CAPACITY_BUCKET)

    def fuse(self, fn, key, shared=()):
        """`fn` compiled once per input layout, graphs shared by every runner in the process under
        `key` (hashable: it must name everything `fn` computes with besides its tensor inputs); rows in
        buckets, as the model's steps (`Fused`)."""
        return Fused(fn, key, shared, defer=self.defer)

    def forward(self, ids, cache, *, block_size=None, draft_len=0, clean_block_size=None, pad=None, keep=0,
                index=None) -> torch.Tensor:
        call = dict(block_size=block_size, draft_len=draft_len, clean_block_size=clean_block_size, pad=pad, keep=keep,
                    index=index)
        num_clean = ids.shape[1] - draft_len
        ids, pad = _dense(ids), _dense(pad)
        steady = cache is not None and is_steady(num_clean, ids.shape[1])
        given = ids  # bucket pads `ids`; the eager fallbacks run the call as given
        if cache is not None and not steady and (padded := bucket(ids, pad, num_clean)) is not None:
            (ids, pad, num_clean), steady = padded, True
        if not steady:
            return self._eager(given, cache, call)
        m = self.model
        clean_bs, block = m.check_stream(ids, cache, block_size, draft_len, clean_block_size, static=True)
        rows = ids.shape[0]
        run_ids, run_pad, run_cache = pad_rows(ids, pad, cache, bucket_width(rows))
        key = _shape_key(run_ids, run_pad, run_cache, keep, draft_len, clean_bs, block)
        if key not in self._replays and (m in _graphs_full or self.defer):  # a shape no graph was compiled for
            if self.defer and m not in _graphs_full:
                _deferred.setdefault(m, {})[key] = None
            return self._eager(given, cache, call)
        replay = self._replays.get(key) if self.replay else None
        if replay is not None and not replay.current():
            replay = self._replays[key] = None  # a weight changed layout: dynamo recompiles, that graph is captured
        logits = replay(run_ids, run_pad, run_cache) if replay is not None else None
        if logits is None:
            logits = self._through_dynamo(key, run_ids, run_pad, run_cache, keep, draft_len, clean_bs, block)
            if logits is None:
                return self._eager(given, cache, call)
        else:
            self.replayed_calls += 1
        self.compiled_calls += 1
        if run_cache is not cache:
            logits = logits[:rows]
            if cache.recording:  # the spare rows' records go: rollback rewinds the real rows
                cache.trim_records(rows)
        m.commit_lens(cache, num_clean, pad)
        return logits if index is None else logits[:, index]

    def _eager(self, ids, cache, call: dict) -> torch.Tensor:
        self.eager_calls += 1
        return super().forward(ids, cache, **call)

    def _through_dynamo(self, key, ids, pad, cache, keep, draft_len, clean_bs, block) -> torch.Tensor | None:
        """The step through dynamo, which compiles the key's graph if it has none; the key is then known:
        with its Replay where this call captured the graph, else with None (CUDA graphs: dynamo's call
        replays them). None when dynamo refused a new graph (its recompile limit) before running anything
        (no cache write yet): this and every later new shape of the model run eagerly (same logits), the
        compiled ones still replay."""
        del self._captures[:]
        raise_recompile_limits()  # in this thread (the step may have been made in another)
        try:
            logits = self.step_fn(self.model, ids, pad, cache, keep, draft_len, clean_bs, block)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            warnings.warn(f"compiled runner: dynamo's recompile limit ({torch._dynamo.config.recompile_limit} "
                          "graphs) reached, new shapes now run eagerly", stacklevel=3)
            _graphs_full.add(self.model)
            return None
        if self._captures:
            self._replays[key] = Replay.build(self._captures.pop(), self.model, logits, ids, pad, cache)
        else:
            self._replays.setdefault(key, None)
        return logits

    def compile_shape(self, key: tuple) -> None:
        """Compile the graph of a shape key (`_shape_key`) on a cache and ids of its own (zeros: only
        the layouts matter) and keep its Replay, as a call of that shape would have."""
        (shape, device, draft_len, clean_bs, block, no_pad, recording, capacity, rows, dtype, keep, grad,
         inference) = key
        cache = CloverCache(self.model.config, rows, capacity, device=device, dtype=dtype)
        if recording:
            cache.start_recording()
        ids = torch.zeros(shape, dtype=torch.long, device=device)
        pad = None if no_pad else torch.zeros(shape, dtype=torch.bool, device=device)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            self._through_dynamo(key, ids, pad, cache, keep, draft_len, clean_bs, block)


_deferred: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {shape key: None}, oldest first
_deferred_fused: dict = {}  # Fused graph key -> the Fused that ran it eagerly (deferring)


def deferred(model) -> int:
    """How many shapes of `model` (and fused-function layouts) wait for `compile_deferred`."""
    return len(_deferred.get(model, ())) + len(_deferred_fused)


def compile_deferred(model) -> bool:
    """Compile one graph that a deferring runner (`CompiledRunner(defer=True)`) of `model` ran eagerly
    (a fused-function layout first, then the oldest model shape); False when none waits."""
    if _deferred_fused:
        k, fused = _deferred_fused.popitem()
        fused.compile(k)
        return True
    waiting = _deferred.get(model)
    if not waiting:
        return False
    key = next(iter(waiting))
    del waiting[key]
    runner = CompiledRunner(model)
    if key not in runner._replays and model not in _graphs_full:
        runner.compile_shape(key)
    return True


_replays: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {shape key: Replay or None}
_graphs_full: "weakref.WeakSet" = weakref.WeakSet()  # models whose step hit dynamo's recompile limit: new shapes run eagerly


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` with the strides of a new tensor of its shape. A graph and its Replay are made for the
    strides they were called with, and a slice of a wider tensor (a prompt chunk) keeps its row
    stride even at one row, so the same shape came with other strides and went through dynamo's
    guards instead of its Replay (~60 AR calls in the task prompts' decode)."""
    if t is None or t.stride() == _contiguous_strides(t.shape):
        return t
    return t.new_empty(t.shape).copy_(t)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _shape_key(ids, pad, cache, keep, draft_len, clean_bs, block) -> tuple:
    """Everything a compiled step specialises on besides the (fixed) weights: one graph, one Replay."""
    return (tuple(ids.shape), ids.device, draft_len, clean_bs, block, pad is None, cache.recording, cache.capacity,
            cache.batch_size, cache.dtype, keep, torch.is_grad_enabled(), torch.is_inference_mode_enabled())


_fused_graphs: dict = {}  # (key, input layouts, mode flags) -> compiled graph
fused_compiles = [0]  # graphs `Fused` compiled in this process (tests count recompilation)


class Fused:
    """A pure tensor function traced (make_fx, fake tensors) and compiled (inductor) once per input
    layout, then called directly: no dynamo frame, no guards. Its inputs are all tensors, so the
    layouts are the whole key; its Python constants are the caller's `key`. Its per-row inputs (all
    but the positions `shared`) come with spare zero rows up to a `bucket_width`, as the model's
    steps do (`pad_rows`), and the outputs' spare rows are dropped."""

    def __init__(self, fn, key, shared=(), defer: bool = False):
        self.fn, self.key = fn, key
        self.shared = frozenset(shared)
        self.defer = defer  # a layout with no graph yet runs eagerly and waits for `compile_deferred`

    def __call__(self, *args):
        graph = _fused_graphs.get(self._key(args))
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
        return self.key, tuple(_layout_of(a) for a in args), torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def _call(self, *args):
        k = self._key(args)
        graph = _fused_graphs.get(k)
        if graph is None:
            if self.defer:
                _deferred_fused[k] = self
                return tuple(self.fn(*args))
            graph = self._compile(k, args)
        return tuple(graph(*args))

    def compile(self, k) -> None:
        """Compile the graph of a key `_call` deferred, on zeros of its input layouts."""
        if k not in _fused_graphs:
            _, layouts, grad, inference = k
            args = [torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
                    for shape, stride, dtype, device in layouts]
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                self._compile(k, args)

    def _compile(self, k, args):
        from torch._inductor.compile_fx import compile_fx
        from torch.fx.experimental.proxy_tensor import make_fx

        gm = make_fx(self.fn, tracing_mode="fake")(*args)
        with torch._inductor.config.patch(cpp_wrapper=CPP_WRAPPER and args[0].device.type == "cpu"):
            graph = _fused_graphs[k] = compile_fx(gm, list(args))
        fused_compiles[0] += 1
        return graph


def make_runner(kind: str, model, defer: bool = False) -> EagerRunner:
    """`defer` (compiled): new shapes run eagerly until `compile_deferred` compiles them (a server)."""
    if kind == "eager":
        return EagerRunner(model)
    if kind == "compiled":
        return CompiledRunner(model, defer=defer)
    raise ValueError(f"unknown runner {kind!r} (known: {', '.join(RUNNERS)})")
