"""fp32 linear for the few rows of a decode step, on a weight packed once (CPU; `tiled.cpp`).

Why: torch's fp32 GEMMs suit large products; for a decode step's 1-64 rows MKL repacks the weight on
every call and oneDNN has a fixed cost per call. `clover_cpu::linear` packs each weight once into
panels of 16 output columns and runs tiles of up to 8 rows x 2 panels in vector registers, the
panel pair in L1 while every row tile passes over it: the weight is read once per call
(measurements: bench/linear.py, BENCHMARKS.md).

* bf16 panels: weights whose values are all bf16 numbers (a bf16 checkpoint loaded as fp32) are
  packed as bf16 and widened exactly as they are loaded: the same products in the same order, half
  the bytes. On CPUs with AMX-BF16, calls of 6+ rows on bf16 panels run on AMX tiles: x is split
  into three bf16 terms (x = x1 + x2 + x3 to 2^-27 relative, finer than fp32's own rounding), each
  product with a bf16 weight is exact in fp32 and AMX sums them in fp32, so the result keeps fp32
  accuracy (tests: within 1e-6 of the summed |products| of an fp64 reference); `use_amx(False)`
  turns it off.
* CPUs without AVX-512 build AVX2 + FMA tiles (16 registers of 8 floats: a panel is two halves, every
  tile holds 8 accumulators: 1 row x 4 panels, 2 rows x 2, or up to 4 rows x 1). Every output is one
  FMA chain in k order whatever the tile, so a row's result does not depend on the rows it shares a
  call with. A CPU with neither builds plain C++ loops, which `ops.linear.worth_routing` never routes to.
* bf16 activations (opt-in: `use_bf16_activations(True)`, `CLOVER_LINEAR_DTYPE=bfloat16`,
  `--linear-dtype bfloat16`): bf16 panels take x rounded to bf16, as llama.cpp's bf16 matmuls do, on
  AVX512-BF16's vdpbf16ps and, on AMX, one term instead of three. Products are exact, so the error
  is x's rounding (2^-9 relative; tests: within 1e-6 of an fp64 reference on the rounded x). Only
  these weight linears: torch's own matmuls (attention, the delta rule) stay fp32, which is why this
  is not torch's fp32 matmul precision "medium". Read on every call, so a compiled graph follows it
  without recompiling; a CPU without bf16 products keeps the exact kernel (`bf16_dot()`).
* Threads (parallel.h): a call whose work gives every thread at least `parallel_min_work`
  multiply-adds (default 2^19) splits its panel pairs (the experts op: its used experts) over
  `torch.get_num_threads()` threads (`--threads`): the caller and helper threads of the extension's
  own, which claim runs of panels from a shared counter, so a helper that starts late (a busy machine)
  takes less and is never waited for. Smaller calls, such as the default model's projections of a
  decode step, stay on the calling thread. The numbers do not depend on the split.

The op keeps the packed copy per weight tensor (weakly: a freed weight's copy goes at the next
miss) and repacks when the weight's version counter moves (`copy_`, `load_state_dict`, an
optimizer step), so it never serves a stale weight; it costs one copy of each weight's bytes. A
weight made under `torch.inference_mode` has no version counter: it runs unpacked (at::linear).
Eager forwards never call it; compiled CPU graphs do where `ops.linear.graph_linear_kernel` says so.

The same extension holds int4.cpp (`clover_cpu::int4_linear`, see int4_linear.py),
ops/gated_delta_rule/unit_lower_solve.cpp (`unit_lower_solve` below), ops/gated_delta_rule/recurrent_step.cpp, ops/greedy_pick/greedy_pick.cpp and ops/block_attention/decode.cpp. The C++ source is compiled by torch.utils.cpp_extension
(`-O3 -march=native`, cached under torch's extensions dir, rebuilt when the source changes): by
`make install`, by `clover serve` before it serves and `clover generate` before it decodes (`prepare`,
which says so when it compiles), else on the first `available()`. Where that fails (no compiler) or the CPU is not x86-64, `available()` is
False and graphs keep torch's ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("tiled.cpp")
# the other CPU ops built into the same extension (one compile, one library): see each file's header
_MORE_SOURCES = (Path(__file__).parent.parent / "gated_delta_rule" / "unit_lower_solve.cpp",
                 Path(__file__).parent.parent / "gated_delta_rule" / "recurrent_step.cpp",
                 Path(__file__).parent.parent / "greedy_pick" / "greedy_pick.cpp",
                 Path(__file__).parent.parent / "block_attention" / "decode.cpp",
                 Path(__file__).with_name("int4.cpp"), Path(__file__).with_name("int4_q8.cpp"))
_CFLAGS = ("-O3", "-march=native")  # part of the build folder's key (`_name`)
_state: dict = {"bf16_x": os.environ.get("CLOVER_LINEAR_DTYPE", "float32") == "bfloat16"}
LINEAR_DTYPES = ("float32", "bfloat16")  # CLOVER_LINEAR_DTYPE / --linear-dtype


def available() -> bool:
    """Whether `clover_cpu::linear` is loaded (built on the first call; False where it cannot be).
    `clover serve` and `clover generate` call it at start-up (`prepare`), never inside a request."""
    if "ok" not in _state:
        _state["ok"] = _load()
    return _state["ok"]


def prepare(say=None) -> bool:
    """Build (or load) the kernels now, before any request needs them; `say(line)` is told first
    when a build compiles (no built library for these sources yet). Returns `available()`."""
    if "ok" not in _state and say is not None and _supported() and needs_build():
        say(f"clover: building the C++ CPU kernels (once; cached in {_build_dir()}) ...")
    return available()


def prepare_for(model) -> bool:
    """`prepare` for a model on the CPU (others never call the kernels), said on stderr."""
    device = getattr(model, "device", None)
    return getattr(device, "type", None) == "cpu" and prepare(lambda line: print(line, file=sys.stderr, flush=True))


def _supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.environ.get("CLOVER_NO_TILED") != "1"


def _name() -> str:
    """The extension's name, keyed by its sources' folder, their contents (headers included) and build flags:
    two checkouts or versions of clover on one machine build into folders of their own instead of rebuilding,
    under each other's running processes, the one library torch's extensions dir would hold (ninja rebuilds
    everything when only the sources' paths change)."""
    digest = hashlib.sha256(" ".join(_CFLAGS).encode())
    digest.update(str(_SOURCE.parent.resolve()).encode() + b"\0")
    for path in sorted((_SOURCE, *_MORE_SOURCES, *_SOURCE.parent.glob("*.h"))):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"clover_cpu_ops_{digest.hexdigest()[:12]}"


def _build_dir(name: str | None = None) -> Path:
    """Where torch builds the extension `name` (default: `_name()`, which hashes the sources)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name or _name(), verbose=False))


def needs_build() -> bool:
    """Whether loading the kernels compiles them: no library built from these sources yet."""
    return not list(_build_dir().glob("clover_cpu_ops*.so"))


@contextlib.contextmanager
def _one_builder(folder: Path):
    """torch's build lock is a file (`lock` in the build folder) that a build killed midway leaves behind, and
    every later load then waits on it for ever. Clover's loaders first take an flock on a file beside it,
    which the system releases when its holder dies: the holder is the one live builder, so a `lock` file it
    finds was left by a dead one and goes."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's lock alone
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "clover.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        yield


def _load() -> bool:
    if not _supported():
        return False
    try:
        from torch.utils.cpp_extension import load

        name = _name()
        with _one_builder(_build_dir(name)):
            load(name=name, sources=[str(_SOURCE), *map(str, _MORE_SOURCES)], extra_cflags=list(_CFLAGS),
                 is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no headers: torch's own linear serves
        warnings.warn(f"clover: the tiled fp32 linear could not be built ({type(e).__name__}: {e}); "
                      "compiled CPU graphs keep torch's linear", stacklevel=2)
        return False

    for path in torch.ops.loaded_libraries:  # its C entry points (`c_shims`) then resolve in a graph's library
        if Path(path).name.startswith("clover_cpu_ops"):
            lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
            _state["c_shims"] = all(hasattr(lib, f"aoti_torch_cpu_{name}") for name in _C_SHIMS)
    torch.ops.clover_cpu.use_bf16_activations(_state["bf16_x"])
    least = os.environ.get("CLOVER_PARALLEL_MIN_WORK", "")  # `parallel_min_work` for a whole process
    if least.isdigit():
        torch.ops.clover_cpu.parallel_min_work(int(least))
    _state["simd"] = str(torch.ops.clover_cpu.simd())

    @torch.library.register_fake("clover_cpu::linear")
    def _(x, weight, bias=None):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("clover_cpu::experts")
    def _(x, top_idx, top_w, gate_up, down):
        return torch.empty_like(x)

    def int4_linear(x, packed, sz, group_size, n):
        return x.new_empty(*x.shape[:-1], n)

    def int4_experts(x, top_idx, top_w, gate_up, gate_up_sz, down, down_sz, group_size, inter):
        return torch.empty_like(x)

    for kind in ("int4", "int4_q8"):  # int4.cpp, int4_q8.cpp: the same signatures
        torch.library.register_fake(f"clover_cpu::{kind}_linear", int4_linear)
        torch.library.register_fake(f"clover_cpu::{kind}_experts", int4_experts)

    @torch.library.register_fake("clover_cpu::unit_lower_solve")
    def _(system, rhs):
        return rhs.new_empty(rhs.shape)

    @torch.library.register_fake("clover_cpu::recurrent_step_")
    def _(q, k, v, g, beta, scale, state):
        return v.new_empty(v.shape)

    @torch.library.register_fake("clover_cpu::decode_attention")
    def _(q, k, v, mask, scale):
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    @torch.library.register_fake("clover_cpu::greedy_pick")
    def _(logits, banned):
        return logits.new_empty(logits.shape[:-1], dtype=torch.long), logits.new_empty(logits.shape[:-1])

    return True


def fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def simd() -> str:
    """The vector tiles the op was built with for this CPU: "avx512", "avx2" (with FMA), or "none" (plain
    C++, or the op not built)."""
    return _state["simd"] if available() else "none"  # read once when built: dynamo traces through callers


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for fp32 CPU tensors through `clover_cpu::linear` (packed weight)."""
    if not available():
        raise RuntimeError("the tiled fp32 linear is not available on this machine")
    return torch.ops.clover_cpu.linear(x, weight, bias)


def tiled_experts(x, top_idx, top_w, gate_up, down) -> torch.Tensor:
    """ops/moe/naive.py's routed experts through `clover_cpu::experts`: each used expert's rows run
    through its packed gate_up and down (the same weight cache as `tiled_linear`), the pair outputs
    summed per token in slot order. One opaque op with static output shape: a compiled graph calls
    it for any token count."""
    if not available():
        raise RuntimeError("the tiled fp32 kernels are not available on this machine")
    return torch.ops.clover_cpu.experts(x, top_idx, top_w, gate_up, down)


def bf16_panels(weight: torch.Tensor) -> bool:
    """Whether the op keeps `weight` (a linear's, or a stack of experts') in bf16 panels: its values
    are all bf16 numbers (a bf16 checkpoint loaded as fp32) and the kernels have vector tiles (AVX-512 or
    AVX2, `simd()`); packs it now."""
    return fp32_cpu(weight) and available() and bool(torch.ops.clover_cpu.packed_bf16(weight))


def cached_weights() -> int:
    """How many live weights have a packed copy (for tests)."""
    return torch.ops.clover_cpu.cached_weights() if available() else 0


def unit_lower_solve(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True) for fp32 CPU
    tensors through `clover_cpu::unit_lower_solve` (row-by-row forward substitution)."""
    if not available():
        raise RuntimeError("the clover CPU ops are not available on this machine")
    return torch.ops.clover_cpu.unit_lower_solve(system, rhs)


def bf16_dot() -> bool:
    """Whether the kernels have a bf16 product (AVX512-BF16, built for this CPU): only then do bf16
    activations (`use_bf16_activations`) change what `clover_cpu::linear` computes."""
    return bool(torch.ops.clover_cpu.bf16_dot()) if available() else False


def use_bf16_activations(on: bool) -> bool:
    """Let bf16 panels take bf16-rounded activations (where `bf16_dot()`); returns the previous
    setting. Process-wide, like `use_amx`; does not build the kernels."""
    was, _state["bf16_x"] = _state["bf16_x"], bool(on)
    if _state.get("ok"):
        torch.ops.clover_cpu.use_bf16_activations(bool(on))
    return was


def bf16_activations() -> bool:
    """Whether bf16 activations are asked for (they run where `bf16_dot()`)."""
    return _state["bf16_x"]


def parallel_min_work(least: int) -> int:
    """Set the multiply-adds each thread must get before a kernel call splits over torch's threads
    (`torch.get_num_threads()`, parallel.h; 0: any call of two or more units splits); returns the
    previous value (-1 where the kernels are not built). For benchmarks and tests; a process's
    start value can come from CLOVER_PARALLEL_MIN_WORK (digits)."""
    return int(torch.ops.clover_cpu.parallel_min_work(int(least))) if available() else -1


def parallel_helpers_only(on: bool) -> bool:
    """Tests only: a call that splits leaves every unit to the helper threads (the caller claims none),
    so what a helper computes is what the test sees; returns the previous setting."""
    return bool(torch.ops.clover_cpu.parallel_helpers_only(on)) if available() else False


def use_amx(on: bool) -> bool:
    """Turn the AMX path of bf16 panels (4+ rows) on or off; returns whether it was in use (False
    where the CPU, the compiler or the OS offers no AMX tiles)."""
    return bool(torch.ops.clover_cpu.use_amx(on)) if available() else False


# The C entry points of the ops a compiled graph calls (each .cpp's `aoti_torch_cpu_<op>`), declared as
# inductor's C++ wrapper declares them: with these, a graph calls the op directly instead of through
# the dispatcher (a by-name lookup and boxed arguments every call).
_C_SHIMS = {
    "linear": "AOTITorchError aoti_torch_cpu_linear(AtenTensorHandle x, AtenTensorHandle weight, "
              "AtenTensorHandle* bias, AtenTensorHandle* ret0)",
    "experts": "AOTITorchError aoti_torch_cpu_experts(AtenTensorHandle x, AtenTensorHandle top_idx, "
               "AtenTensorHandle top_w, AtenTensorHandle gate_up, AtenTensorHandle down, AtenTensorHandle* ret0)",
    "unit_lower_solve": "AOTITorchError aoti_torch_cpu_unit_lower_solve(AtenTensorHandle system, AtenTensorHandle rhs, "
                        "AtenTensorHandle* ret0)",
}


class _Shims(dict):
    """{op overload: [its C declaration]}, pickled by op name: inductor's FX graph cache pickles its config
    into the cache key, and an op overload itself does not pickle (the graph would bypass the cache)."""

    def __reduce__(self):
        return _shims, (tuple(sorted(op.name().removeprefix("clover_cpu::") for op in self)),)


def _shims(names: tuple = tuple(_C_SHIMS)) -> _Shims:
    return _Shims({getattr(torch.ops.clover_cpu, name).default: [_C_SHIMS[name]] for name in names})


def c_shims() -> dict:
    """{op overload: [its C declaration]} for inductor's `aot_inductor.custom_ops_to_c_shims` (empty where
    the ops are not built or their library does not export the entry points globally: then graphs call the
    ops through the dispatcher)."""
    return _shims() if available() and _state.get("c_shims") else {}
