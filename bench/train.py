"""Training throughput: Clover's training step vs transformers' Qwen3NextForCausalLM, same dims.

    python bench/train.py [--preset clover-small] [--batch 8] [--seq 256] [--repeats 3] [--threads 1]

One training step = forward + loss + backward + AdamW step, fp32, random weights of identical shapes
and random tokens. Candidates run alternately in one process (medians; clover/utils/timing.py):
* clover AR step (the `ar` objective, the same maths as transformers);
* transformers Qwen3NextForCausalLM AR step;
* clover block-diffusion step at block 32 (the [x_t ; x_0] layout: twice the columns, no twin).
Tokens/s counts the batch's tokens (seq x batch), for the diffusion step the clean tokens once.
--threads defaults to 1: on a shared 2-core machine two intra-op threads are oversubscribed and
several times slower for both models.
"""

from __future__ import annotations

import argparse
import os

import torch

from clover.convert.mapping import qwen3next_twin
from clover.models import CloverForBlockDiffusion, preset_config
from clover.training.objectives import ar_loss, block_diffusion_loss
from clover.utils.timing import time_alternately


def step_fn(model, opt, loss_fn):
    def step():
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="clover-small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    cfg = preset_config(args.preset)
    dev = args.device
    torch.manual_seed(0)
    ours = CloverForBlockDiffusion(cfg).to(dev).train()
    torch.manual_seed(0)
    hf = qwen3next_twin(cfg).to(dev).train()
    ids = torch.randint(0, cfg.vocab_size - 1, (args.batch, args.seq), device=dev)
    ones = torch.ones_like(ids, dtype=torch.bool)
    gen = torch.Generator(device=dev).manual_seed(0)
    o_opt = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    h_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4)
    cands = {
        "clover AR step": step_fn(ours, o_opt, lambda: ar_loss(ours, ids, ones)[0]),
        "transformers Qwen3NextForCausalLM AR step": step_fn(hf, h_opt, lambda: hf(ids, labels=ids).loss),
        f"clover block-diffusion step (block {args.block})": step_fn(
            ours, o_opt, lambda: block_diffusion_loss(ours, ids, ones, args.block, generator=gen)[0]),
    }
    times = time_alternately(cands, repeats=args.repeats, warmup=args.warmup)
    ntok = args.batch * args.seq
    ref = times["transformers Qwen3NextForCausalLM AR step"]
    print(f"`python bench/train.py --preset {args.preset} --batch {args.batch} --seq {args.seq} --block {args.block} "
          f"--repeats {args.repeats} --threads {args.threads} --device {dev}` (torch {torch.__version__}, fp32)\n")
    print("| training step | median s | tokens/s | vs transformers AR |")
    print("|---|---:|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {t:.2f} | {ntok / t:.0f} | {ref / t:.2f}x |")


if __name__ == "__main__":
    main()
