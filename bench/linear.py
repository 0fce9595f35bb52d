"""fp32 linears on a CPU, per row count, at a model's projection shapes: torch's F.linear (MKL),
oneDNN on a weight packed once (torch.ops.mkldnn, the other library kernel torch ships) and
`clover_cpu::linear` (clover/ops/linear/tiled.py, what compiled graphs route to where
`worth_routing` says so), on fp32 weights and on weights whose values are all bf16 (a bf16
checkpoint loaded as fp32, as the shipped models: bf16 panels, AVX-512 or AVX2 tiles or, from 6 rows on
CPUs with AMX, AMX tiles on x split into three bf16 terms). Outputs are checked against the naive
reference first. Thread CPU time, all timed alternately (each call finds its weight in the caches:
the hot case); the two bf16-panel columns each switch AMX on or off before their call (`use_amx`).

    python bench/linear.py [--model DIR] [--threads 1] [--rows 1,8,16,32,64]
"""

from __future__ import annotations

import opbench  # bench/opbench.py
import time

import torch


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


if __name__ == "__main__":
    main()
