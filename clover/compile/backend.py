"""The inductor backend of a CPU step: its graphs' ops that have a clover_cpu kernel are sent to it
(the choice is each op's, in clover/ops), the graph is compiled with inductor's C++ wrapper, and
every graph it compiles is remembered with the inputs and outputs of the call that compiled it (for
a `Replay`).

Inductor's own loops are compiled for one thread (`cpp.threads`): a step's large ops are clover_cpu
kernels that split over threads of their own (ops/linear/parallel.h), and what inductor fuses between
them is small at decode shapes, where an OpenMP region per loop (a team woken and joined each time)
costs more than the loop. A shape's graph is then the same code whatever torch's thread count and
whoever compiles it (the process itself, or a server's compiling child, which runs on one thread)."""

from __future__ import annotations

import torch

from ..ops.gated_delta_rule import graph_solve_kernel
from ..ops.linear import graph_linear_kernel, tiled


def capturing_backend(captures: list, c_shims: bool):
    """Inductor, remembering each graph it compiles in `captures` with the real inputs of the call
    that compiled it and that call's outputs; `c_shims`: the graphs call the clover_cpu ops' C entry
    points instead of going through the dispatcher."""

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        route_ops(gm)
        config = {"cpp_wrapper": True, "cpp.threads": 1, **(c_shim_config() if c_shims else {})}
        with torch._inductor.config.patch(config):
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


def c_shim_config() -> dict:
    """The inductor config that makes a C++-wrapper graph call the clover_cpu ops' C entry points."""
    return {"aot_inductor.custom_ops_to_c_shims": tiled.c_shims()}


def _example(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def route_linears(gm) -> int:
    """Send the graph's linears whose kernel choice (`ops.linear.graph_linear_kernel`) is a clover
    op to it; the weight must be a graph input (a parameter), whose packed copy is then made once.
    Returns how many were routed."""
    routed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (torch._C._nn.linear, torch.nn.functional.linear):
            continue
        args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
        if not (isinstance(args[0], torch.fx.Node) and isinstance(args[1], torch.fx.Node) and args[1].op == "placeholder"):
            continue
        kernel = graph_linear_kernel(_example(args[0]), _example(args[1]))
        if kernel is not None:
            node.target, node.args, node.kwargs = kernel, tuple(args[:3]), {}
            routed += 1
    if routed:
        gm.recompile()
    return routed


def route_solves(gm) -> int:
    """Send the graph's triangular solves whose kernel choice (`ops.gated_delta_rule.graph_solve_kernel`)
    is a clover op to it. Returns how many were routed."""
    routed = 0
    for node in gm.graph.nodes:
        if (node.op != "call_function" or node.target is not torch.linalg.solve_triangular or len(node.args) != 2
                or not all(isinstance(n, torch.fx.Node) for n in node.args)):
            continue
        kernel = graph_solve_kernel(*(_example(n) for n in node.args), **node.kwargs)
        if kernel is not None:
            node.target, node.kwargs = kernel, {}
            routed += 1
    if routed:
        gm.recompile()
    return routed


def route_ops(gm) -> int:
    """A CPU graph's ops that have a clover_cpu kernel sent to it: linears, then chunk solves."""
    return route_linears(gm) + route_solves(gm)
