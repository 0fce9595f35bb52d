"""fp32 linears on a CPU: torch's F.linear (MKL) vs `clover::packed_linear` (oneDNN on a weight
packed once), per row count, at a model's projection shapes. Sets where `worth_packing`
(clover/ops/linear/packed.py) routes a compiled graph's linears on this machine; outputs are checked
against the naive reference first. Thread CPU time, the two timed alternately.

    python bench/linear.py [--model DIR] [--threads 1] [--rows 1,8,16,32]
"""

from __future__ import annotations

import argparse
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
    from clover.api import DEFAULT_MODEL
    from clover.models import CloverConfig
    from clover.ops.linear import naive_linear, packed_linear, worth_packing
    from clover.utils.timing import time_alternately

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder whose config gives the shapes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = CloverConfig.from_pretrained(args.model)
    print(f"`python bench/linear.py --threads {args.threads} --rows {args.rows}` (torch {torch.__version__}, "
          f"{args.threads} thread(s); microseconds per call, thread CPU time, median)\n")
    print("| projection | out x in | rows | F.linear (MKL) | packed oneDNN | packed / F.linear | routed when compiled "
          "| max abs diff vs naive |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    torch.manual_seed(0)
    with torch.no_grad():  # not inference_mode: its tensors have no version counter, so they are never packed
        for name, (n, k) in shapes(cfg).items():
            w = torch.randn(n, k) * k**-0.5
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(1, rows, k)
                diff = (packed_linear(x, w) - naive_linear(x, w)).abs().max().item()
                t = time_alternately({"mkl": lambda: naive_linear(x, w), "packed": lambda: packed_linear(x, w)},
                                     repeats=args.repeats, warmup=10, clock=time.thread_time)
                a, b = 1e6 * t["mkl"], 1e6 * t["packed"]
                print(f"| {name} | {n} x {k} | {rows} | {a:.1f} | {b:.1f} | {b / a:.2f}x | "
                      f"{'yes' if worth_packing(rows, w) else 'no'} | {diff:.1e} |")


if __name__ == "__main__":
    main()
