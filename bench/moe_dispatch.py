"""Expert dispatch inside a compiled step: gathered (weights gathered into the graph), the opaque
grouped-GEMM op and the tiled C++ op on packed expert weights (what a CPU fp32 graph runs from
`TILED_PAIRS` pairs), per token count, at a model's MoE dims. Sets where `GATHER_PAIRS`
(clover/ops/moe/__init__.py, `experts`) should sit where the tiled op is not used; outputs are checked
against the naive reference first.

    python bench/moe_dispatch.py [--model DIR] [--threads 1] [--tokens 1,2,4,8,16,32,48,64]
"""

from __future__ import annotations

import opbench  # bench/opbench.py

import torch


def main() -> None:
    from clover.ops.linear import tiled_experts
    from clover.ops.moe import GATHER_PAIRS, gathered_experts, grouped_experts_op, naive_experts
    from clover.utils.timing import time_alternately

    args, cfg = opbench.parse(__doc__, "--tokens", "1,2,4,8,16,32,48,64", "MoE dims")
    e, h, i, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    torch.manual_seed(0)
    gate_up, down = torch.randn(e, 2 * i, h) * h**-0.5, torch.randn(e, h, i) * i**-0.5
    gathered = torch.compile(gathered_experts, dynamic=False)
    grouped = torch.compile(grouped_experts_op, dynamic=False)
    tiled = torch.compile(tiled_experts, dynamic=False)
    print(f"`python bench/moe_dispatch.py --threads {args.threads} --tokens {args.tokens}` ({e} experts, top {k}, "
          f"hidden {h}, expert inter {i}; torch {torch.__version__}, {args.threads} thread(s); GATHER_PAIRS = {GATHER_PAIRS})\n")
    print("| tokens | pairs | gathered, compiled (us) | grouped op, compiled (us) | tiled op, compiled (us) "
          "| gathered / grouped | tiled / gathered | max abs diff vs naive |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for t in [int(v) for v in args.tokens.split(",")]:
            x = torch.randn(t, h)
            top_w, top_idx = torch.randn(t, e).softmax(-1).topk(k)
            top_w = top_w / top_w.sum(-1, keepdim=True)
            ref = naive_experts(x, top_idx, top_w, gate_up, down)
            fns = {"gathered": gathered, "grouped": grouped, "tiled": tiled}
            diff = max((f(x, top_idx, top_w, gate_up, down) - ref).abs().max().item() for f in fns.values())
            times = time_alternately({name: (lambda f=f: f(x, top_idx, top_w, gate_up, down)) for name, f in fns.items()},
                                     repeats=args.repeats, warmup=10)  # interleaved: load hits all alike
            a, b, c = (1e6 * times[n] for n in fns)
            print(f"| {t} | {t * k} | {a:.1f} | {b:.1f} | {c:.1f} | {a / b:.2f}x | {c / a:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
