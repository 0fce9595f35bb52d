"""Decode step time, eager vs compiled runner, beside the hardware floor of each step.

    python bench/update.py step -- python bench/step.py --threads 1

One process, the shipped default model (or --model DIR) in fp32 with a prefilled cache of
--context tokens; steps as the engine runs them: an AR step (1 token committed) and draft steps of
8/16/32 tokens (logits on every column, nothing committed). Eager and compiled run alternately
(medians). The floor of a step is max(bytes of the weights it reads (2 a weight for bf16 values) / measured memory bandwidth,
its FLOPs / measured fp32 GEMM rate, the faster of torch's matmul and oneDNN's): a step reads every dense weight, the lm head and the experts
its tokens route to (all of them once T * top_k >= experts), and does 2 FLOPs per weight per token.

Each step is timed twice per sample: wall time and this thread's CPU time (`time.thread_time`); on
a machine shared with other processes the wall time also counts the time the scheduler gave them.
`--burst K` makes a sample K consecutive calls of one step (the mean), as a decode runs them (AR
steps follow AR steps, an AR step commits its token, so the cache grows by K); with the default
K = 1 every call follows another candidate's, whose weights and buffers evicted this one's from
the caches (pessimistic for a model that fits in the last-level cache).

    python bench/update.py step-c-shims -- python bench/step.py --threads 1 --repeats 10 --burst 8 --runners compiled,compiled-dispatcher

sets the compiled graphs beside a second copy of the model whose graphs call the clover_cpu ops through
the dispatcher instead of their C entry points (`CompiledRunner(c_shims=False)`).

    python bench/step.py --profile [--sizes 1,32]

prints, instead, a torch.profiler summary per runner and step size: aten ops per step, wall time,
time inside aten ops and inside other recorded regions (a compiled graph's own kernels, dynamo's
frame), time outside any recorded event (Python, guards), and the top ops by self time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from clover.api import DEFAULT_MODEL
from clover.engine.runner import CompiledRunner, make_runner
from clover.models import CloverForBlockDiffusion
from clover.utils.timing import time_alternately


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device):
    """This thread's CPU time on a CPU (see the module docstring); wall time after a sync on CUDA."""
    if device.type == "cuda":
        return lambda: (_sync(device), time.perf_counter())[1]
    return time.thread_time


def bandwidth(device=torch.device("cpu")) -> float:
    """Bytes/s of a large copy (read + write), best of a few (thread CPU time: the hardware's rate,
    not the share of it a loaded machine's scheduler leaves us)."""
    a = torch.empty(64 * 2**20 * (16 if device.type == "cuda" else 1), device=device)  # past the caches
    b = torch.empty_like(a)
    clock, best = _clock(device), float("inf")
    for _ in range(5):
        t = clock()
        b.copy_(a)
        best = min(best, clock() - t)
    return 2 * a.numel() * 4 / best


def gemm_rate(device=torch.device("cpu"), dtype=torch.float32) -> float:
    """FLOP/s of a 1024^3 GEMM, best of a few (thread CPU time, as above), by the fastest library
    torch reaches: its matmul and, on a CPU in fp32, oneDNN on a packed weight (the compiled
    runner's draft linears; on AMD CPUs it runs AVX-512 kernels where MKL runs AVX2 ones, ~2x)."""
    n = 8192 if device.type == "cuda" else 1024
    x, w = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    fns = [lambda: x @ w]
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        fns.append(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    clock, best = _clock(device), float("inf")
    for fn in fns:
        for _ in range(5):
            t = clock()
            fn()
            best = min(best, clock() - t)
    return 2 * n**3 / best


def weight_itemsize(model) -> int:
    """Bytes a weight takes as read: 2 when every weight is a bf16 value (a bf16 checkpoint loaded as
    fp32: the tiled kernels keep it in bf16 panels), else the model dtype's."""
    bf16_valued = all(torch.equal(p, p.bfloat16().to(p.dtype)) for p in model.parameters() if p.dim() >= 2)
    return 2 if bf16_valued else model.dtype.itemsize


# the last layer's weights that take every column (its K/V or GDN state inputs): Clover's fused qkv_proj
# and in_proj, the Qwen families' k_proj / v_proj, LLaDA2's fused query_key_value
EVERY_COLUMN = ("qkv_proj", "in_proj", "k_proj", "v_proj", "query_key_value")


def forward_floor(model, itemsize: int, bw: float, rate: float):
    """seconds(columns, kept) of one forward at the floor: max(weight bytes it reads / `bw`, weight
    FLOPs / `rate`), `itemsize` bytes a weight. Every column runs the layers; the last layer's output
    projection and MLP and the head run only for the `kept` columns whose logits come out; the
    experts are read in the share their tokens can route to (all of them once T * top_k >= experts)
    and multiplied at top_k / experts of their weights per token. Weight products only (attention
    scores and the delta rule's state work are left out: a lower bound)."""
    c = model.config
    last = f"model.layers.{c.num_hidden_layers - 1}."
    share = c.num_experts_per_tok / c.num_experts if getattr(c, "num_experts", 0) else 0.0  # 0: a dense family
    every, kept_only, experts, last_experts = 0, 0, 0, 0  # weights per column, per kept column; routed stacks
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed" in name or "conv" in name:  # embed_tokens; word_embeddings (LLaDA2)
            continue
        if ".experts." in name:
            if name.startswith(last):
                last_experts += p.numel()
            else:
                experts += p.numel()
        elif name.startswith(last) and not any(k in name for k in EVERY_COLUMN) or name.startswith("lm_head"):
            kept_only += p.numel()  # the last layer's K/V (or GDN state) inputs take every column
        else:
            every += p.numel()

    def seconds(columns: int, kept: int) -> float:
        flops = 2 * (columns * (every + experts * share) + kept * (kept_only + last_experts * share))
        nbytes = itemsize * (every + kept_only + experts * min(1.0, columns * share) + last_experts * min(1.0, kept * share))
        return max(nbytes / bw, flops / rate)

    return seconds


def load_model(args):
    """The shipped default model (or --model), or random weights at a preset's dims (--preset)."""
    dtype = getattr(torch, args.dtype)
    if args.preset is None:
        return CloverForBlockDiffusion.from_pretrained(args.model or DEFAULT_MODEL, dtype=dtype).to(args.device).eval()
    from clover.models.configuration_clover import preset_config

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on its device: 35B params in fp32 would not fit
    try:
        with torch.device(args.device):
            model = CloverForBlockDiffusion(preset_config(args.preset))
            model.apply(model._init_weights)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def profile_steps(candidates: dict, setup, steps: int = 20, top: int = 5) -> None:
    """The torch.profiler summary of `steps` calls of each (runner, size) candidate (already warm)."""
    from torch.profiler import ProfilerActivity, profile

    print("| runner | tokens | wall ms/step | aten ops/step | ms in aten ops | ms in other regions "
          "| ms outside events | top ops by self time (ms/step) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for (kind, n), fn in candidates.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall = 0.0
            for _ in range(steps):
                setup(kind)
                t = time.perf_counter()
                fn()
                wall += time.perf_counter() - t
        events = [e for e in prof.key_averages() if e.key not in ("cudaDeviceSynchronize",)]
        # setup (cache restore) runs under the profiler too: leave its copies out of the counts
        setup_ops = {"aten::copy_", "aten::clone", "aten::empty_like", "aten::empty_strided"}
        aten = [e for e in events if e.key.startswith("aten::")]
        in_aten = sum(e.self_cpu_time_total for e in aten) / 1e3 / steps
        other = sum(e.self_cpu_time_total for e in events if not e.key.startswith("aten::")) / 1e3 / steps
        ops = sum(e.count for e in aten if e.key not in setup_ops) / steps
        tops = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
        top_s = ", ".join(f"{e.key} x{e.count / steps:g} {e.self_cpu_time_total / 1e3 / steps:.2f}" for e in tops)
        w = wall * 1e3 / steps
        print(f"| {kind} | {n} | {w:.2f} | {ops:.0f} | {in_aten:.2f} | {other:.2f} | {max(0.0, w - in_aten - other):.2f} "
              f"| {top_s} |")
    print(f"\n(ops/step leaves out the cache restore's copies between steps; their time is in the ms columns.)")


def _extra(args) -> str:
    return "".join(f" --{k} {v}" for k, v in (("device", args.device), ("dtype", args.dtype), ("preset", args.preset),
                                              ("burst", args.burst))
                   if v not in (None, "cpu", "float32", 1)) + ("" if args.runners.count(",") == 2 else f" --runners {args.runners}")


def make(kind: str, model, args):
    """The runner of a --runners kind: eager, compiled, compiled-dynamo (the compiled graphs called
    through dynamo's guards), compiled-dispatcher (a second copy of the model whose graphs call the
    clover_cpu ops through the dispatcher, not their C entry points: `c_shims=False`)."""
    if kind == "compiled-dynamo":
        return CompiledRunner(model, replay=False)  # shares the graphs
    if kind == "compiled-dispatcher":
        return CompiledRunner(load_model(args), c_shims=False)  # a copy of the model: its graphs are its own
    return make_runner(kind, model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model folder (default: the shipped default model)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", default="1,8,16,32", help="tokens per step; 1 = AR step")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler summary per step instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--preset", help="random weights at a built-in preset's dims instead of a model folder")
    ap.add_argument("--runners", default="eager,compiled,compiled-dynamo",
                    help="of eager, compiled, compiled-dynamo, compiled-dispatcher (see `make`)")
    ap.add_argument("--burst", type=int, default=1, help="consecutive calls per timed sample (see above)")
    args = ap.parse_args()
    if args.profile and args.burst != 1:
        ap.error("--profile summarises single calls: leave out --burst")
    torch.set_num_threads(args.threads)
    model = load_model(args)
    device = model.device
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size - 1, (1, args.context), device=device)
    kinds = args.runners.split(",")
    runners = {kind: make(kind, model, args) for kind in kinds}
    caches = {}
    with torch.inference_mode():
        for kind, r in runners.items():
            cache = r.new_cache(1, args.context + 64 + args.burst)
            model(prompt, cache=cache)
            caches[kind] = (cache, cache.snapshot())
    candidates, compile_s = {}, {}
    for kind, r in runners.items():
        cache, _ = caches[kind]
        for n in sizes:
            ids = prompt[:, -n:]
            if n == 1:
                fn = (lambda r=r, c=cache, ids=ids: (r.forward(ids, c, logits_to_keep=1), _sync(device)))
            else:
                fn = (lambda r=r, c=cache, ids=ids, n=n: (r.forward(ids, c, block_size=n, draft_len=n, clean_block_size=n,
                                                                    logits_to_keep=n), _sync(device)))
            candidates[(kind, n)] = fn if args.burst == 1 else (lambda fn=fn: [fn() for _ in range(args.burst)])
    with torch.inference_mode():
        for key, fn in candidates.items():  # first call = compilation (cold, unless inductor's cache has it)
            for _ in range(2):  # the first compiles (or loads) the shape's graph, the second replays it
                t = time.perf_counter()
                fn()
                caches[key[0]][0].restore(caches[key[0]][1])
                compile_s.setdefault(key, time.perf_counter() - t)
        restore = lambda name: caches[name.split()[0]][0].restore(caches[name.split()[0]][1])  # noqa: E731
        if args.profile:
            print(f"`python bench/step.py --profile --context {args.context} --sizes {args.sizes} "
                  f"--threads {args.threads}` ({torch.get_num_threads()} thread(s), torch {torch.__version__}, fp32)\n")
            profile_steps({k: fn for k, fn in candidates.items() if k[0] != "compiled-dynamo"}, restore)
            return
        times, cpu = {}, {}
        for _ in range(2):  # wall and thread-CPU samples interleaved in halves, so load drifts hit both
            for out, clock in ((times, time.perf_counter), (cpu, _clock(device))):
                got = time_alternately({f"{k} {n}": fn for (k, n), fn in candidates.items()},
                                       repeats=max(1, args.repeats // 2), setup=restore, clock=clock)
                for name, v in got.items():
                    out.setdefault(name, []).append(v / args.burst)
        times = {name: statistics.median(v) for name, v in times.items()}
        cpu = {name: statistics.median(v) for name, v in cpu.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    bw, rate = bandwidth(device), gemm_rate(device, model.dtype)
    print(f"`python bench/step.py --context {args.context} --sizes {args.sizes} --repeats {args.repeats} "
          f"--threads {args.threads}{_extra(args)}` ({torch.get_num_threads()} thread(s), torch {torch.__version__}, "
          f"{model.dtype} on {device}; measured: copy bandwidth {bw / 1e9:.1f} GB/s, {model.dtype} GEMM {rate / 1e9:.1f} GFLOP/s; load average "
          f"{load:.1f} on {os.cpu_count()} CPUs)\n")
    print("| ms per step | " + " | ".join("1 token (AR)" if n == 1 else f"{n}-token draft" for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for kind in runners:
        print(f"| {kind} | " + " | ".join(f"{times[f'{kind} {n}'] * 1e3:.2f}" for n in sizes) + " |")
    for kind in runners:
        print(f"| {kind} ({'thread CPU time' if device.type == 'cpu' else 'synced wall, 2nd half'}) | " + " | ".join(f"{cpu[f'{kind} {n}'] * 1e3:.2f}" for n in sizes) + " |")
    floor = forward_floor(model, weight_itemsize(model), bw, rate)
    floors = [floor(n, n) for n in sizes]  # every column's logits: an AR step's one, a draft's all
    print("| floor | " + " | ".join(f"{f * 1e3:.2f}" for f in floors) + " |")
    comp = [k for k in runners if k.startswith("compiled")] or list(runners)
    label = "best compiled" if comp[0].startswith("compiled") else comp[0]
    best = {n: min(times[f"{k} {n}"] for k in comp) for n in sizes}
    print(f"| {label} / floor | " + " | ".join(f"{best[n] / f:.1f}x" for n, f in zip(sizes, floors)) + " |")
    if "eager" in runners and label == "best compiled":
        print("| eager / best compiled | " + " | ".join(f"{times[f'eager {n}'] / best[n]:.2f}x" for n in sizes) + " |")
    best_cpu = {n: min(cpu[f"{k} {n}"] for k in comp) for n in sizes}
    print(f"| {label} CPU time / floor | " + " | ".join(f"{best_cpu[n] / f:.1f}x" for n, f in zip(sizes, floors)) + " |")
    print("\nFirst call (compile, or inductor's on-disk cache when warm) of each compiled shape: "
          + ", ".join(f"{n} tok {compile_s[(comp[0], n)]:.1f} s" for n in sizes) + ".")


if __name__ == "__main__":
    main()
