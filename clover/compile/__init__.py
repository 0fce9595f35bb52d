"""The compile machinery behind `engine.runner.CompiledRunner`.

The steady steps (an AR token, a draft window, a window plus the block it commits), layout
included, are one `torch.compile` graph each (inductor; on CUDA `mode="reduce-overhead"`, CUDA
graphs). Shapes are static: the attention layers write the step's K/V into the cache in place and
read its whole capacity (masked past each row's length; a public family's, only the slots in
use, in power-of-two spans: `attention_span`), capacities and rows come in buckets, and
prompt chunks are left-padded to a bucket (`shapes`). On a CPU the graph's kernels are called by
inductor's C++ wrapper, and its ops that have a clover_cpu kernel are sent to it (`backend`; which
op runs which kernel is each op's choice, in clover/ops). A graph is compiled once per shape
(`ShapeKey`) and replayed after: on a CPU by calling the captured graph directly (`Replay`: no
dynamo guard evaluation). A mode's pure tensor functions are traced once per input layout and
called as one graph (`Fused`).

Everything compiled for a model lives in its `CompileState` (`state_of(model)`), shared by every
compiled runner on that model: it calls a shape's graph (`call`: its Replay, else through dynamo),
queues the shapes a deferring runner ran eagerly and compiles them one at a time (`compile_next`).
"""

from .backend import c_shim_config, capturing_backend, route_linears, route_ops, route_solves
from .fused import Fused
from .replay import Replay
from .shapes import (
    CAPACITY_BUCKET,
    STEADY_MAX,
    SPAN_MIN,
    ShapeKey,
    attention_span,
    bucket,
    bucket_width,
    dense,
    is_steady,
    pad_rows,
    shape_key,
)
from .state import RECOMPILE_LIMIT, CompileState, state_of

__all__ = [
    "CAPACITY_BUCKET", "RECOMPILE_LIMIT", "SPAN_MIN", "STEADY_MAX", "CompileState", "Fused", "Replay", "ShapeKey",
    "attention_span", "bucket",
    "bucket_width", "c_shim_config", "capturing_backend", "dense", "is_steady", "pad_rows", "route_linears",
    "route_ops", "route_solves", "shape_key", "state_of",
]
