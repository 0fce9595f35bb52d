"""What is compiled for one model: its step function, the graphs and Replays of its shapes, the
shapes and fused-function layouts waiting to be compiled, the fused functions' graphs."""

from __future__ import annotations

import threading
import warnings
import weakref

import torch

from ..models.modeling_clover import stream_layout
from ..ops.linear import tiled
from .backend import capturing_backend
from .replay import Replay
from .shapes import ShapeKey

# graphs of the step function per model (shape buckets x variants): `clover tune`'s default grid on
# all held-out prompts needs ~80; past the limit new shapes run eagerly
RECOMPILE_LIMIT = 256


def _step(model, ids, pad_mask, cache, logits_to_keep: int, draft_len: int, clean_block_size: int, block: int,
          span: int = 0, sub_block_head: bool = False, head: int = 0):
    """One steady step, layout included: its masks and positions are a dozen small ops on the
    cache's lengths, fused into the graph here. A model behind the seam that lays out its own step
    (`graph_step`: the public families, models/family_seam.py) runs that instead, its attention
    reading the first `span` cache slots (0: all), a sub-block step's draft (`sub_block_head`) computing
    only the logits that step reads (`head`: on that many columns, `head_width`)."""
    graph_step = getattr(model, "graph_step", None)
    if graph_step is not None:
        asked = {"sub_block_head": True} if sub_block_head else {}
        if head:
            asked["head"] = head
        return graph_step(ids, pad_mask, cache, logits_to_keep, draft_len, clean_block_size, block, span, **asked)
    layout = stream_layout(model.config, ids.shape[0], ids.shape[1], draft_len, clean_block_size, block, cache,
                           pad_mask, ids.device, static=True)
    return model.head(model.model(ids, layout, cache, logits_to_keep), logits_to_keep)


class CompileState:
    """Everything compiled for one model (`state_of`), shared by every compiled runner on it.

    `c_shims`: the CPU graphs call the clover_cpu ops' C entry points (False: through the
    dispatcher); fixed when the step function is made."""

    def __init__(self, model=None, c_shims: bool = True):
        self.model = weakref.ref(model) if model is not None else None
        self.c_shims = c_shims
        self.step_fn = None
        self.captures: list = []  # graphs the backend compiled in the current call (CPU)
        self.replays: dict = {}  # ShapeKey -> Replay, or None (compiled, called through dynamo)
        self.untraced: set = set()  # keys whose Replay was loaded from the disk cache: dynamo has no graph of them
        self.deferred: dict = {}  # ShapeKey -> None, oldest first: ran eagerly, wait for `compile_next`
        self.full = False  # the step hit dynamo's recompile limit: new shapes run eagerly
        self.fused_graphs: dict = {}  # (key, input layouts, mode flags) -> compiled graph
        self.fused_deferred: dict = {}  # the same keys -> the Fused that ran them eagerly
        self.fused_compiles = 0  # graphs compiled for fused functions (tests count recompilation)
        self._limits = threading.local()  # `raised`: this thread raised dynamo's recompile limits
        self._before = threading.local()  # `fn`: what runs in this thread right before its next Replay graph call

    def step(self):
        """The model's compiled step function, made on the first call."""
        if self.step_fn is None:
            self.raise_recompile_limits()
            model = self.model()
            if model.device.type == "cuda":  # CUDA graphs replay there; dynamo's call stays in front of them
                self.step_fn = torch.compile(_step, dynamic=False, fullgraph=True, mode="reduce-overhead")
            else:
                tiled.available()  # the clover_cpu kernels built (or loaded) before tracing: graphs route to them
                for m in model.modules():  # modules that choose kernels by what their weights hold
                    if hasattr(m, "prepare_for_graphs"):
                        m.prepare_for_graphs()
                backend = capturing_backend(self.captures, self.c_shims)
                self.step_fn = torch.compile(_step, dynamic=False, fullgraph=True, backend=backend)
        return self.step_fn

    def raise_recompile_limits(self) -> None:
        """dynamo's recompile limits up to RECOMPILE_LIMIT, once per thread: its config is per thread,
        so a limit raised where the step was made leaves the default to another thread that compiles
        (a server's scheduler compiling deferred shapes). Once: a lower limit set afterwards stays."""
        if not getattr(self._limits, "raised", False):
            for limit in ("recompile_limit", "accumulated_recompile_limit"):  # per code object, and over all
                setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), RECOMPILE_LIMIT))
            self._limits.raised = True

    def waiting(self) -> int:
        """How many shapes and fused-function layouts wait for `compile_next`."""
        return len(self.deferred) + len(self.fused_deferred)

    def call(self, key: ShapeKey, ids, pad_mask, cache, replay: bool = True, defer: bool = False):
        """(logits, whether a Replay gave them) of the key's graph on these inputs: its Replay
        (`replay`), else through dynamo, which compiles the graph if it has none. (None, False) where
        the call must run eagerly, before any cache write: a shape with no graph when `defer` (queued
        for `compile_next`) or past the recompile limit. A step that asks for its head
        (`sub_block_head`) of a model with `head_width(ids, logits_to_keep, draft_len)` has a graph per
        head width (`ShapeKey.head`), read here from the ids."""
        head_width = getattr(self.model(), "head_width", None) if key.sub_block_head and self.model else None
        if head_width is not None:
            key = key._replace(head=head_width(ids, key.logits_to_keep, key.draft_len))
        if key not in self.replays and (self.full or defer):
            if defer and not self.full:
                self.deferred[key] = None
            return None, False
        found = self.replays.get(key) if replay else None
        # None too where the Replay is not `current()` or the call does not fit it
        logits = found(ids, pad_mask, cache, self.run_before_graph) if found is not None else None
        if logits is not None:
            return logits, True
        if found is not None and key not in self.untraced and not found.current():
            self.replays[key] = None  # a weight changed layout: dynamo recompiles, that graph is captured
        if key in self.untraced:  # a loaded graph that does not fit this call: no dynamo graph behind it
            self.untraced.discard(key)
            del self.replays[key]
            return self.call(key, ids, pad_mask, cache, replay, defer)
        return self.through_dynamo(key, ids, pad_mask, cache), False

    def before_next_graph(self, fn) -> None:
        """`fn()` runs once, in this thread, right before its next Replay graph call of this model
        (replacing one set before and not run yet): the moment the thread lets go of the GIL for the
        graph's whole run (a server hands its posts to the event loop's thread there)."""
        self._before.fn = fn

    def run_before_graph(self) -> None:
        fn = getattr(self._before, "fn", None)
        if fn is not None:
            self._before.fn = None
            fn()

    def through_dynamo(self, key: ShapeKey, ids, pad_mask, cache) -> torch.Tensor | None:
        """The step through dynamo, which compiles the key's graph if it has none; the key is then
        known: with its Replay where this call captured the graph, else with None (CUDA graphs:
        dynamo's call replays them). None when dynamo refused a new graph (its recompile limit) before
        running anything: this and every later new shape run eagerly, the compiled ones still replay."""
        step, model = self.step(), self.model()
        del self.captures[:]
        self.raise_recompile_limits()  # in this thread (the step may have been made in another)
        try:
            logits = step(model, ids, pad_mask, cache, key.logits_to_keep, key.draft_len, key.clean_block_size,
                          key.block, key.span, key.sub_block_head, key.head)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            warnings.warn(f"compiled runner: dynamo's recompile limit ({torch._dynamo.config.recompile_limit} "
                          "graphs) reached, new shapes now run eagerly", stacklevel=4)
            self.full = True
            return None
        if self.captures:
            self.replays[key] = Replay.build(self.captures.pop(), model, logits, ids, pad_mask, cache)
        else:
            self.replays.setdefault(key, None)
        return logits

    def load(self, key, graph: dict) -> bool:
        """Take a graph the compiling child finished, loaded by its cache key without a trace
        (`stored`): a shape's Replay or a fused-function layout's graph. False where it does not
        load so: the key stays queued."""
        from .stored import load, load_replay

        self.step()  # what a trace would have set up first: the kernels the graphs call, the weights' graph layouts
        if key in self.fused_deferred:
            try:
                self.fused_graphs[key] = load(graph["aot"])
            except Exception:  # noqa: BLE001 - gone from the cache: compiled the traced way
                return False
            del self.fused_deferred[key]
            return True
        replay = load_replay(self.model(), graph)
        if replay is None:
            return False
        self.deferred.pop(key, None)
        self.replays[key] = replay
        self.untraced.add(key)
        return True

    def compile_shape(self, key: ShapeKey) -> None:
        """Compile the graph of a shape key on a cache and ids of its own (zeros: only the layouts
        matter) and keep its Replay, as a call of that shape would have."""
        cache = self.model().new_cache(key.rows, capacity=key.capacity)
        if key.recording:
            cache.start_recording()
        ids = torch.zeros(key.shape, dtype=torch.long, device=key.device)
        pad_mask = None if key.no_pad else torch.zeros(key.shape, dtype=torch.bool, device=key.device)
        with torch.inference_mode(key.inference), torch.set_grad_enabled(key.grad):
            self.through_dynamo(key, ids, pad_mask, cache)

    def compile_next(self, ready=None) -> bool:
        """Compile one graph a deferring runner ran eagerly (a fused-function layout first, then the
        oldest model shape; among the keys in `ready` when given); False when none waits."""
        k = next((k for k in self.fused_deferred if ready is None or k in ready), None)
        if k is not None:
            self.fused_deferred.pop(k).compile(k)
            return True
        key = next((k for k in self.deferred if ready is None or k in ready), None)
        if key is None:
            return False
        del self.deferred[key]
        if key not in self.replays and not self.full:
            self.compile_shape(key)
        return True


_states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its CompileState


def state_of(model, c_shims: bool | None = None) -> CompileState:
    """The model's compile state, made on first use (`c_shims` then: see CompileState)."""
    state = _states.get(model)
    if state is None:
        state = _states[model] = CompileState(model, c_shims=True if c_shims is None else c_shims)
    return state
