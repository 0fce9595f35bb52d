"""Decode step time, eager vs compiled runner, beside the hardware floor of each step.

    python bench/update.py step -- python bench/step.py --threads 1

One process, the shipped default model (or --model DIR) in fp32 with a prefilled cache of
--context tokens; steps as the engine runs them: an AR step (1 token committed) and draft steps of
8/16/32 tokens (logits on every column, nothing committed). Eager and compiled run alternately
(medians). The floor of a step is max(bytes of the weights it reads / measured memory bandwidth,
its FLOPs / measured fp32 GEMM rate): a step reads every dense weight, the lm head and the experts
its tokens route to (all of them once T * top_k >= experts), and does 2 FLOPs per weight per token.
"""

from __future__ import annotations

import argparse
import time

import torch

from clover.api import DEFAULT_MODEL
from clover.engine.runner import CompiledRunner, make_runner
from clover.models import CloverForBlockDiffusion
from clover.utils.timing import time_alternately


def bandwidth() -> float:
    """Bytes/s of a large copy (read + write), best of a few."""
    a = torch.empty(64 * 2**20 // 4 * 4)  # 256 MiB: well past the caches
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best


def gemm_rate() -> float:
    """fp32 FLOP/s of a 1024^3 matmul, best of a few."""
    x, w = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x @ w
        best = min(best, time.perf_counter() - t)
    return 2 * 1024**3 / best


def step_weights(model, tokens: int) -> tuple[float, float]:
    """(bytes read, weights used per token) by a step of `tokens` tokens."""
    c = model.config
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n) - c.vocab_size * c.hidden_size
    used = min(1.0, tokens * c.num_experts_per_tok / c.num_experts)  # embedding rows: negligible
    per_token = dense + expert * c.num_experts_per_tok / c.num_experts
    return 4.0 * (dense + expert * used), per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model folder (default: the shipped default model)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", default="1,8,16,32", help="tokens per step; 1 = AR step")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = CloverForBlockDiffusion.from_pretrained(args.model or DEFAULT_MODEL, dtype=torch.float32).eval()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size - 1, (1, args.context))
    runners = {kind: make_runner(kind, model) for kind in ("eager", "compiled")}
    runners["compiled-skip-guards"] = CompiledRunner(model, skip_guards=True)  # shares the compiled graphs
    caches = {}
    with torch.inference_mode():
        for kind, r in runners.items():
            cache = r.new_cache(1, args.context + 64)
            model(prompt, cache=cache)
            caches[kind] = (cache, cache.snapshot())
    candidates, compile_s = {}, {}
    for kind, r in runners.items():
        cache, _ = caches[kind]
        for n in sizes:
            ids = prompt[:, -n:]
            if n == 1:
                fn = (lambda r=r, c=cache, ids=ids: r.forward(ids, c, keep=1))
            else:
                fn = (lambda r=r, c=cache, ids=ids, n=n: r.forward(ids, c, block_size=n, draft_len=n, clean_block_size=n, keep=n))
            candidates[(kind, n)] = fn
    with torch.inference_mode():
        for key, fn in candidates.items():  # first call = compilation (cold, unless inductor's cache has it)
            for _ in range(2):  # the second call registers the shape as seen (skip-guards replays from then)
                t = time.perf_counter()
                fn()
                caches[key[0]][0].restore(caches[key[0]][1])
                compile_s.setdefault(key, time.perf_counter() - t)
        times = time_alternately({f"{k} {n}": fn for (k, n), fn in candidates.items()}, repeats=args.repeats,
                                 setup=lambda name: caches[name.split()[0]][0].restore(caches[name.split()[0]][1]))
    bw, rate = bandwidth(), gemm_rate()
    print(f"`python bench/step.py --context {args.context} --sizes {args.sizes} --repeats {args.repeats} "
          f"--threads {args.threads}` ({torch.get_num_threads()} thread(s), torch {torch.__version__}, fp32; "
          f"measured: copy bandwidth {bw / 1e9:.1f} GB/s, fp32 GEMM {rate / 1e9:.1f} GFLOP/s)\n")
    print("| ms per step | " + " | ".join("1 token (AR)" if n == 1 else f"{n}-token draft" for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for kind in runners:
        print(f"| {kind} | " + " | ".join(f"{times[f'{kind} {n}'] * 1e3:.2f}" for n in sizes) + " |")
    floors = []
    for n in sizes:
        nbytes, per_token = step_weights(model, n)
        floors.append(max(nbytes / bw, 2 * per_token * n / rate))
    print("| floor | " + " | ".join(f"{f * 1e3:.2f}" for f in floors) + " |")
    best = {n: min(times[f"compiled {n}"], times[f"compiled-skip-guards {n}"]) for n in sizes}
    print("| best compiled / floor | " + " | ".join(f"{best[n] / f:.1f}x" for n, f in zip(sizes, floors)) + " |")
    print("| eager / best compiled | " + " | ".join(f"{times[f'eager {n}'] / best[n]:.2f}x" for n in sizes) + " |")
    print("\nFirst call (compile, or inductor's on-disk cache when warm) of each compiled shape: "
          + ", ".join(f"{n} tok {compile_s[('compiled', n)]:.1f} s" for n in sizes) + ".")


if __name__ == "__main__":
    main()
