"""fp32 linears on a CPU, per row count, at a model's projection shapes: torch's F.linear (MKL),
oneDNN on a weight packed once (torch.ops.mkldnn, the other library kernel torch ships) and
`clover_cpu::linear` (clover/ops/linear/tiled.py, what compiled graphs route to where
`worth_routing` says so), on fp32 weights and on weights whose values are all bf16 (a bf16
checkpoint loaded as fp32, as the shipped models: bf16 panels, AVX-512 or AVX2 tiles or, from 6 rows on
CPUs with AMX, AMX tiles on x split into three bf16 terms). Outputs are checked against the naive
reference first. Thread CPU time, all timed alternately (each call finds its weight in the caches:
the hot case); the two bf16-panel columns each switch AMX on or off before their call (`use_amx`).

    python bench/linear.py [--model DIR] [--threads 1] [--rows 1,8,16,32,64]

`--scaling`: the C++ kernels (fp32 tiles, int4 tiles on fp32 and on int8 activations, routed experts in
each) at 1 and 2 threads (wall time: a split call uses both), at the projection shapes of
`bench/serve_peer.py`'s sizes; rounds interleave the thread counts (order alternating), each round times
a batch of calls at each; the table gives each count's median over rounds, the ratio of those medians (1
thread / 2: above 1, two threads are faster) and the spread of the per-round ratios (min-max), whether
the call splits at the kernels' default work threshold (`tiled.parallel_min_work`; `--min-work` sets
another for the run, 0: every call splits), and the load average before and after.

    python bench/linear.py --scaling [--sizes default,large] [--rows 1,4,16] [--rounds 15] [--min-work N]
"""

from __future__ import annotations

import opbench  # bench/opbench.py
import os
import statistics
import sys
import time

import torch


INT8_MACS_PER_FP32 = 3  # the int8 multiply-adds parallel.h counts as one fp32 one (kInt8MacsPerFp32)


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out, in) of the dense projections a step runs, by name."""
    h, kd, vd = cfg.hidden_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kh, vh = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"lm head": (cfg.vocab_size, h), "GDN in": (2 * kh * kd + 2 * vh * vd + 2 * vh, h),
            "attention qkv": (2 * q + 2 * kv, h), "shared expert gate_up": (2 * cfg.shared_expert_intermediate_size, h),
            "out / down": (h, h)}


def main() -> None:
    from clover.ops.linear import naive_linear, tiled, tiled_linear, worth_routing
    from clover.utils.timing import time_alternately

    args, cfg = opbench.parse(__doc__, "--rows", "1,8,16,32,64", "shapes")
    print(f"`python bench/linear.py --threads {args.threads} --rows {args.rows}` (torch {torch.__version__}, "
          f"{args.threads} thread(s); microseconds per call, thread CPU time, median)\n")
    amx = tiled.use_amx(True)
    print(f"Vector tiles: {tiled.simd()}; AMX tiles {'in use' if amx else 'not available'} for bf16 panels\n")
    print("| projection | out x in | rows | F.linear (MKL) | oneDNN packed | tiled | tiled / F.linear | tiled / oneDNN "
          f"| bf16 panels, {tiled.simd()} | bf16 panels, AMX | AMX / {tiled.simd()} | routed when compiled | max abs diff vs naive |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    torch.manual_seed(0)

    def with_amx(on, fn):
        return lambda: (tiled.use_amx(on), fn())

    with torch.no_grad():  # not inference_mode: its tensors have no version counter, so they are never packed
        for name, (n, k) in shapes(cfg).items():
            w = torch.randn(n, k) * k**-0.5
            wb = w.bfloat16().float()  # bf16 values: bf16 panels
            onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, k)
                diff = max((tiled_linear(x, w) - naive_linear(x, w)).abs().max().item(),
                           (tiled_linear(x, wb) - naive_linear(x, wb)).abs().max().item())
                t = time_alternately({"mkl": lambda: naive_linear(x, w),
                                      "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
                                      "tiled": lambda: tiled_linear(x, w),
                                      "avx512": with_amx(False, lambda: tiled_linear(x, wb)),
                                      "amx": with_amx(True, lambda: tiled_linear(x, wb))},
                                     repeats=args.repeats, warmup=10, clock=time.thread_time)
                a, o, b, v, m = (1e6 * t[k] for k in ("mkl", "onednn", "tiled", "avx512", "amx"))
                print(f"| {name} | {n} x {k} | {rows} | {a:.1f} | {o:.1f} | {b:.1f} | {b / a:.2f}x | {b / o:.2f}x | "
                      f"{v:.1f} | {m:.1f} | {m / v:.2f}x | {'yes' if worth_routing(w) else 'no'} | {diff:.1e} |")
    tiled.use_amx(True)


def kernel_cases(cfg, rows: int) -> dict:
    """{label: (call, multiply-adds)} of the C++ kernels at the config's shapes and `rows` rows (tokens)."""
    from clover.ops.linear import int4_linear as il, int4_q8 as q8, tiled
    from clover.quant.int4 import quantize_rtn

    torch.manual_seed(0)
    cases = {}
    for name, (n, k) in shapes(cfg).items():
        w, x = torch.randn(n, k) * k**-0.5, torch.randn(rows, k)
        stored = quantize_rtn(w, 128)
        (packed, sz), (p8, s8) = il.pack(**stored), q8.pack(**stored)
        cases[f"{name} {n} x {k} fp32"] = (lambda x=x, w=w: tiled.tiled_linear(x, w), rows * n * k)
        cases[f"{name} {n} x {k} int4"] = (lambda x=x, p=packed, s=sz, n=n: il.int4_linear(x, p, s, 128, n), rows * n * k)
        cases[f"{name} {n} x {k} int4 x int8"] = (lambda x=x, p=p8, s=s8, n=n: q8.int4_q8_linear(x, p, s, 128, n), rows * n * k)
    e, h, i, top = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    gu, dn = torch.randn(e, 2 * i, h) * h**-0.5, torch.randn(e, h, i) * i**-0.5
    x = torch.randn(rows, h)
    top_w, top_idx = torch.softmax(torch.randn(rows, e), -1).topk(top, dim=-1)
    stored = [quantize_rtn(m.reshape(-1, m.shape[-1]), 128) for m in (gu, dn)]
    (gp, gs), (dp, ds) = (il.pack(**st) for st in stored)
    (gp8, gs8), (dp8, ds8) = (q8.pack(**st) for st in stored)
    gp, gs, dp, ds, gp8, gs8, dp8, ds8 = (t.reshape(e, -1, *t.shape[1:]) for t in (gp, gs, dp, ds, gp8, gs8, dp8, ds8))
    work, label = rows * top * 3 * h * i, f"experts {e} x [{2 * i} x {h}, {h} x {i}] top {top}"
    cases[f"{label} fp32"] = (lambda: tiled.tiled_experts(x, top_idx, top_w, gu, dn), work)
    cases[f"{label} int4"] = (lambda: il.int4_experts(x, top_idx, top_w, gp, gs, dp, ds, 128, i), work)
    cases[f"{label} int4 x int8"] = (lambda: q8.int4_q8_experts(x, top_idx, top_w, gp8, gs8, dp8, ds8, 128, i), work)
    return cases


def per_call(fn, calls: int, threads: int) -> float:
    """Wall seconds per call of `calls` calls at `threads` torch threads (after two untimed)."""
    torch.set_num_threads(threads)
    fn(), fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def compare_threads(fn, rounds: int) -> tuple[float, float, list[float]]:
    """(median s per call at 1 thread, at 2, per-round ratios 1 / 2), the counts interleaved."""
    calls = max(5, min(2000, int(2e-3 / max(per_call(fn, 3, 1), 1e-7))))  # about 2 ms a batch
    t = {1: [], 2: []}
    for r in range(rounds):
        for threads in ((1, 2) if r % 2 == 0 else (2, 1)):
            t[threads].append(per_call(fn, calls, threads))
    return statistics.median(t[1]), statistics.median(t[2]), [a / b for a, b in zip(t[1], t[2])]


def scaling(argv: list[str]) -> None:
    import argparse

    from clover.ops.linear import tiled
    from serve_peer import size_config  # bench/serve_peer.py: the sizes its servers run

    ap = argparse.ArgumentParser(description="the C++ kernels at 1 and 2 threads")
    ap.add_argument("--scaling", action="store_true")
    ap.add_argument("--sizes", default="default,large")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--min-work", type=int, help="multiply-adds per thread before a call splits (default: the kernels')")
    args = ap.parse_args(argv)
    assert tiled.available(), "the C++ kernels are not built here"
    least = tiled.parallel_min_work(0)
    least = args.min_work if args.min_work is not None else least
    tiled.parallel_min_work(least)
    load = os.getloadavg()
    print(f"`python bench/linear.py {' '.join(argv)}` (torch {torch.__version__}, vector tiles {tiled.simd()}, "
          f"min work {least} multiply-adds a thread; microseconds per call, wall time, median of {args.rounds} rounds)\n")
    print("| size | kernel | rows | multiply-adds | splits | 1 thread | 2 threads | 1 / 2 (ratio of medians) | rounds' 1 / 2 (min-max) |")
    print("|---|---|---:|---:|---|---:|---:|---:|---|")
    with torch.no_grad():
        for size in args.sizes.split(","):
            for rows in [int(r) for r in args.rows.split(",")]:
                for label, (fn, work) in kernel_cases(size_config(size), rows).items():
                    one, two, ratios = compare_threads(fn, args.rounds)
                    counted = work // INT8_MACS_PER_FP32 if label.endswith("int8") else work
                    print(f"| {size} | {label} | {rows} | {work:,} | {'yes' if counted >= 2 * least else 'no'} | "
                          f"{1e6 * one:.1f} | {1e6 * two:.1f} | {one / two:.2f}x | {min(ratios):.2f}-{max(ratios):.2f} |",
                          flush=True)
    print(f"\nLoad average (1 min) {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after.")


if __name__ == "__main__":
    if "--scaling" in sys.argv:
        scaling(sys.argv[1:])
    else:
        main()
