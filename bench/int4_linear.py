"""int4 linears on a CPU: clover's kernels (`clover_cpu::int4_linear`, clover/ops/linear/int4_linear.py:
fp32 activations, weights dequantised in registers; `clover_cpu::int4_q8_linear`, int4_q8.py: the
activations rounded to int8 per block of 32, integer dot products, the opt-in "int8" kernel) against
torch's (`_weight_int4pack_mm_for_cpu`, bf16 activations) and the fp32 tiled linear (`clover_cpu::linear`,
what compiled fp32 graphs run), per row count and thread count, at the projections of `--size`
(default, or bench/serve_peer.py's large preset); then (`--step`) a whole AR step of that model
(random weights for large) in fp32 and in int4 (RTN, group 128) on each int4 kernel.

Every figure is a median of thread CPU time (the time the scheduler gave other processes left out), the candidates called in
turn (interleaved) in `--rounds` rounds; a ratio is the ratio of the medians over all rounds, and
its spread [min, max] the same ratio per round. Outputs are checked against the dequantised
reference first. Load average before and after each table. At 2 threads thread CPU time counts the
calling thread's share only: torch's int4 kernel splits large products over its pool and clover's
kernels over helper threads of their own (ops/linear/parallel.h), so there the ratios leave out both
pools' shares (bench/linear.py --scaling times the kernels' threads in wall time).

    python bench/update.py int4-linear -- python bench/int4_linear.py --size large --threads 1 --rows 1,4,8,32 --step
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from clover.utils.timing import time_alternately


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"


def rounds(candidates: dict, n_rounds: int, repeats: int, clock, setup=None) -> dict[str, list[float]]:
    """{name: [median seconds per round]}: each round times every candidate alternately."""
    out: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(n_rounds):
        got = time_alternately(candidates, repeats=max(1, repeats // n_rounds), warmup=3, setup=setup, clock=clock)
        for name, v in got.items():
            out[name].append(v)
    return out


def ratio(samples: dict[str, list[float]], a: str, b: str) -> str:
    """median(a) / median(b) over every round, [min, max] of the per-round ratios."""
    whole = statistics.median(samples[a]) / statistics.median(samples[b])
    per = [x / y for x, y in zip(samples[a], samples[b])]
    return f"{whole:.2f}x [{min(per):.2f}, {max(per):.2f}]"


def size_config(size: str):
    from clover.api import DEFAULT_MODEL
    from clover.models import CloverConfig

    config = CloverConfig.from_pretrained(DEFAULT_MODEL)
    if size == "large":
        from serve_peer import LARGE

        config = CloverConfig(**{**config.to_dict(), **LARGE})
    return config


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out, in) of the model's int4 projections, and a square 4096 one."""
    h, kd, vd = cfg.hidden_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kh, vh = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    return {"GDN in": (2 * kh * kd + 2 * vh * vd + 2 * vh, h), "GDN out": (h, vh * vd), "out / down": (h, h),
            "shared expert gate_up": (2 * cfg.shared_expert_intermediate_size, h),
            "expert gate_up": (2 * cfg.moe_intermediate_size, h), "expert down": (h, cfg.moe_intermediate_size),
            "4096 x 4096": (4096, 4096)}


def op_table(args, cfg) -> None:
    from clover.ops.linear import int4_linear as il, int4_q8 as q8, tiled_linear
    from clover.quant.int4 import PackedInt4, dequantize, quantize_rtn

    print("| threads | projection | out x in | rows | int8-act us | clover int4 us | torch int4 us | fp32 tiled us "
          "| int8-act / clover int4 | int8-act / fp32 tiled | clover int4 / fp32 tiled | int8-act max rel. diff "
          "| clover int4 max rel. diff |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    torch.manual_seed(0)
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for name, (n, k) in shapes(cfg).items():
            w = torch.randn(n, k) * k**-0.5
            st = quantize_rtn(w, args.group_size)
            ours = PackedInt4.build(st["qweight"], st["scales"], st["qzeros"], "clover")
            int8 = PackedInt4.build(st["qweight"], st["scales"], st["qzeros"], "clover_q8")
            aten = PackedInt4.build(st["qweight"], st["scales"], st["qzeros"], "cpu")
            wq = dequantize(**st)
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, k)
                ref = x.double() @ wq.double().T
                diff, diff8 = (((p.matmul(x).double() - ref).abs().max() / ref.abs().max()).item() for p in (ours, int8))
                s = rounds({"int8": lambda: q8.int4_q8_linear(x, int8.weight, int8.sz, args.group_size, n),
                            "ours": lambda: il.int4_linear(x, ours.weight, ours.sz, args.group_size, n),
                            "aten": lambda: aten.matmul(x), "fp32": lambda: tiled_linear(x, wq)},
                           args.rounds, args.repeats, time.thread_time)
                e, a, b, c = (1e6 * statistics.median(s[key]) for key in ("int8", "ours", "aten", "fp32"))
                print(f"| {threads} | {name} | {n} x {k} | {rows} | {e:.1f} | {a:.1f} | {b:.1f} | {c:.1f} | "
                      f"{ratio(s, 'int8', 'ours')} | {ratio(s, 'int8', 'fp32')} | {ratio(s, 'ours', 'fp32')} | "
                      f"{diff8:.1e} | {diff:.1e} |")
    print(f"\nLoad average (1 min) after the table: {load()} on {os.cpu_count()} CPUs.")


def step_models(args, cfg) -> tuple[str, dict]:
    """(name, {column: model}): the size's model in fp32 (the default checkpoint, or random weights,
    seed 0, for large) and its int4 RTN copies on each kernel."""
    from clover.api import DEFAULT_MODEL
    from clover.models import CloverForBlockDiffusion
    from clover.quant.modules import quantize_rtn_in_place, set_int4_kernel

    if args.size == "large":
        torch.manual_seed(0)
        fp32, title = CloverForBlockDiffusion(cfg).float().eval(), "large (random weights)"
    else:
        fp32, title = CloverForBlockDiffusion.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval(), DEFAULT_MODEL.name
    models = {"fp32": fp32}
    for column, kernel in (("int4 int8-act", "int8"), ("int4 clover", "auto"), ("int4 torch", "aten")):
        models[column] = quantize_rtn_in_place(copy.deepcopy(fp32), args.group_size)
        set_int4_kernel(models[column], kernel)
    return title, models


def step_table(args, cfg) -> None:
    """An AR step (1 token, context 256) of the size's model: fp32, int4 on each kernel, through the
    runners of --runners."""
    from clover.engine.runner import make_runner

    torch.set_num_threads(1)
    title, models = step_models(args, cfg)
    fp32 = models["fp32"]
    prompt = torch.randint(0, fp32.config.vocab_size - 1, (1, 256), generator=torch.Generator().manual_seed(0))
    candidates, caches = {}, {}
    with torch.inference_mode():
        for runner_kind in args.runners.split(","):
            for name, model in models.items():
                r = make_runner(runner_kind, model)
                cache = r.new_cache(1, 256 + 64)
                model(prompt, cache=cache)
                key = f"{runner_kind} {name}"
                caches[key] = (cache, cache.snapshot())
                candidates[key] = lambda r=r, c=cache: r.forward(prompt[:, -1:], c, logits_to_keep=1)
                for _ in range(2):  # a compiled runner compiles (or loads) its graph, then replays it
                    candidates[key]()
                    cache.restore(caches[key][1])
        before = load()
        s = rounds(candidates, args.rounds, args.step_repeats, time.thread_time,
                   setup=lambda key: caches[key][0].restore(caches[key][1]))
    print(f"\nAR step (1 token, context 256) of `{title}` ({sum(p.numel() for p in fp32.parameters()):,} "
          f"parameters), 1 thread, thread CPU ms, median of {args.rounds} rounds; load average {before} before, {load()} after:\n")
    print("| runner | fp32 ms | int4 int8-act ms | int4 clover ms | int4 torch ms | int8-act / fp32 | int8-act / int4 clover "
          "| int4 clover / fp32 | int4 clover / int4 torch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind in args.runners.split(","):
        f, e, o, a = (1e3 * statistics.median(s[f"{kind} {m}"]) for m in models)
        print(f"| {kind} | {f:.2f} | {e:.2f} | {o:.2f} | {a:.2f} | {ratio(s, f'{kind} int4 int8-act', f'{kind} fp32')} "
              f"| {ratio(s, f'{kind} int4 int8-act', f'{kind} int4 clover')} | {ratio(s, f'{kind} int4 clover', f'{kind} fp32')} "
              f"| {ratio(s, f'{kind} int4 clover', f'{kind} int4 torch')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="comma list of torch thread counts for the op table")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--size", choices=("default", "large"), default="default",
                    help="the model whose projections (and --step) are timed: default, or serve_peer.py's large preset")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=100, help="timed calls per candidate (op table)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step", action="store_true", help="also time a whole AR step (fp32 vs int4)")
    ap.add_argument("--step-repeats", type=int, default=50)
    ap.add_argument("--runners", default="eager,compiled", help="runners for --step")
    args = ap.parse_args()
    from clover.ops.linear import tiled

    if not tiled.available():
        raise SystemExit("the clover CPU kernels are not built on this machine")
    print(f"`python bench/int4_linear.py --size {args.size} --threads {args.threads} --rows {args.rows}"
          f"{' --step' if args.step else ''}` "
          f"(torch {torch.__version__}, vector tiles {tiled.simd()}, group size {args.group_size}; load average "
          f"{load()} on {os.cpu_count()} CPUs at start)\n")
    cfg = size_config(args.size)
    op_table(args, cfg)
    if args.step:
        step_table(args, cfg)


if __name__ == "__main__":
    main()
