"""A decode kernel of compiled graphs switched off and on: `--kernel gdn`, the GDN decode step's spec
tensor ops (`fused_recurrent_gated_delta_rule`, then the state copied into the cache) against
`clover_cpu::recurrent_step_` (the state updated where it lies, `ops.gated_delta_rule.step_into`);
`--kernel attention`, the attention layers' one-row masked attention through torch's SDPA against
`clover_cpu::decode_attention` (`ops.block_attention.masked_attention`). On bench/serve_peer.py's
large random model (seed 0; `--int4`: its int4 RTN copy, group 128, int8 activations), AR, --rows
rows of --prompt-tokens-token prompts, --new-tokens new tokens each, compiled runner: the same
engine run with the kernel switched off and on, alternately, after one warm-up round that compiles
both; the tokens must be the same (int4: the share of equal tokens is printed, as the
activations' int8 rounding turns a last-bit difference into a flipped near-tie now and then).

    PYTHONPATH=. python bench/gdn_step.py [--kernel gdn] [--rows 32] [--rounds 3] [--threads 1] [--int4]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernel", choices=("gdn", "attention"), default="gdn")
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--int4", action="store_true", help="the model's int4 copy (int8 activations)")
    args = ap.parse_args()

    import torch

    import clover.models.modeling_clover as modeling
    import clover.ops.block_attention.sdpa as sdpa
    import serve_peer
    from clover.engine import DecodeConfig, Engine
    from clover.models import CloverForBlockDiffusion
    from clover.quant.modules import quantize_rtn_in_place, set_int4_kernel

    torch.set_num_threads(args.threads)
    module, name = (modeling, "step_into") if args.kernel == "gdn" else (sdpa, "decode_kernel")
    kernel, off = getattr(module, name), (lambda *a: None) if args.kernel == "gdn" else (lambda *a: False)
    torch.manual_seed(0)
    spec_model = CloverForBlockDiffusion(serve_peer.size_config("large")).eval()
    if args.int4:
        set_int4_kernel(quantize_rtn_in_place(spec_model, 128), "int8")
    kernel_model = copy.deepcopy(spec_model)  # each model keeps its own compiled graphs
    prompts = [[(7 * r + j) % 3000 + 10 for j in range(args.prompt_tokens)] for r in range(args.rows)]
    cfg = DecodeConfig(mode="ar", block_size=1, max_new_tokens=args.new_tokens, ignore_eos=True, runner="compiled")

    def run(model, on: bool):
        setattr(module, name, kernel if on else off)
        start = time.perf_counter()
        seqs = Engine(model, cfg).generate(prompts)
        return time.perf_counter() - start, [s.token_ids for s in seqs]

    times, same = {False: [], True: []}, []
    with torch.inference_mode():
        for r in range(1 + args.rounds):
            (ts, ids_spec), (tk, ids_kernel) = run(spec_model, False), run(kernel_model, True)
            same.append(statistics.mean(a == b for x, y in zip(ids_spec, ids_kernel) for a, b in zip(x, y)))
            assert args.int4 or same[-1] == 1, "the kernel changed the tokens"
            if r:
                times[False].append(ts)
                times[True].append(tk)
    ratios = [a / b for a, b in zip(times[False], times[True])]
    spec, kern = statistics.median(times[False]), statistics.median(times[True])
    names = ("spec ops", "recurrent_step_") if args.kernel == "gdn" else ("SDPA", "decode_attention")
    print(f"large model{' int4' if args.int4 else ''}, {args.rows} rows, AR, {args.prompt_tokens}-token prompts + "
          f"{args.new_tokens} new, {args.threads} thread(s), {args.rounds} rounds (medians): {names[0]} {spec:.2f} s, "
          f"{names[1]} {kern:.2f} s, {spec / kern:.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}); "
          f"tokens equal: {100 * min(same):.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
