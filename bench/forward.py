"""Forward-pass step times with a cache: Clover vs transformers' Qwen3NextForCausalLM, same dims.

    python bench/forward.py [--preset clover-small] [--context 256] [--repeats 20] [--device cpu]

Prints a markdown table. Both models have random weights of identical shapes; they run alternately
in one process (medians), so the ratios are meaningful even on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
from clover.convert.mapping import qwen3next_twin
from clover.models import CloverForBlockDiffusion, preset_config
from clover.utils.timing import time_alternately


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="clover-small")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (e.g. the 35B dims)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cfg = preset_config(args.preset)
    torch.manual_seed(0)
    ours = CloverForBlockDiffusion(cfg).to(args.device, dtype).eval()
    prompt = torch.randint(0, cfg.vocab_size - 1, (1, args.context), device=args.device)
    one = prompt[:, -1:]
    block = prompt[:, -args.block :]
    cache = ours.new_cache(1, capacity=args.context + 4 * args.block)
    with torch.inference_mode():
        ours(prompt, cache=cache)
    snap = cache.snapshot()
    candidates = {
        "clover 1 token (AR step)": lambda: ours(one, cache=cache),
        f"clover {args.block}-token block step": lambda: ours(block, cache=cache, block_size=args.block, draft_len=args.block),
    }
    restore = {"clover 1 token (AR step)": lambda: cache.restore(snap)}
    if not args.no_hf:
        torch.manual_seed(0)
        hf = qwen3next_twin(cfg).to(args.device, dtype).eval()
        with torch.inference_mode():
            base = hf(prompt, use_cache=True).past_key_values
        live = {}

        def fresh():
            live["cache"] = copy.deepcopy(base)

        candidates["transformers 1 token"] = lambda: hf(one, past_key_values=live["cache"], use_cache=True)
        candidates[f"transformers {args.block} tokens"] = lambda: hf(block, past_key_values=live["cache"], use_cache=True)
        restore["transformers 1 token"] = fresh
        restore[f"transformers {args.block} tokens"] = fresh
    with torch.inference_mode():
        times = time_alternately(candidates, repeats=args.repeats, setup=lambda name: restore.get(name, lambda: None)())
    ref = times["clover 1 token (AR step)"]
    print(f"`python bench/forward.py --preset {args.preset} --context {args.context} --block {args.block} "
          f"--repeats {args.repeats} --device {args.device} --dtype {args.dtype} --threads {args.threads}`"
          f" ({torch.get_num_threads()} threads, torch {torch.__version__})\n")
    print("| step (cached prefix of %d tokens) | median ms | vs clover 1-token |" % args.context)
    print("|---|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.2f} | {t / ref:.2f}x |")
    if not args.no_hf:
        print(f"\nclover 1-token step vs transformers 1-token step: "
              f"{times['transformers 1 token'] / ref:.2f}x faster")
        print(f"clover {args.block}-token block step / clover 1-token step: {times[f'clover {args.block}-token block step'] / ref:.2f}x")


if __name__ == "__main__":
    main()
