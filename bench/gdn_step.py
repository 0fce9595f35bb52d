"""The GDN decode step in compiled graphs: the spec's tensor ops (`fused_recurrent_gated_delta_rule`,
then the state copied into the cache) against `clover_cpu::recurrent_step_` (the state updated where
it lies, `ops.gated_delta_rule.step_into`), on bench/serve_peer.py's large random model (seed 0), AR,
--rows rows of 24-token prompts, 24 new tokens each, compiled runner: the same engine run with the
kernel switched off and on, alternately, after one warm-up round that compiles both; the tokens must
be the same.

    PYTHONPATH=. python bench/gdn_step.py [--rows 32] [--rounds 3] [--threads 1]
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
    args = ap.parse_args()

    import torch

    import clover.models.modeling_clover as modeling
    import serve_peer
    from clover.engine import DecodeConfig, Engine
    from clover.models import CloverForBlockDiffusion

    torch.set_num_threads(args.threads)
    kernel = modeling.step_into
    torch.manual_seed(0)
    spec_model = CloverForBlockDiffusion(serve_peer.size_config("large")).eval()
    kernel_model = copy.deepcopy(spec_model)  # each model keeps its own compiled graphs
    prompts = [[(7 * r + j) % 3000 + 10 for j in range(24)] for r in range(args.rows)]
    cfg = DecodeConfig(mode="ar", block_size=1, max_new_tokens=24, ignore_eos=True, runner="compiled")

    def run(model, on: bool):
        modeling.step_into = kernel if on else (lambda *a: None)
        start = time.perf_counter()
        seqs = Engine(model, cfg).generate(prompts)
        return time.perf_counter() - start, [s.token_ids for s in seqs]

    times = {False: [], True: []}
    with torch.inference_mode():
        for r in range(1 + args.rounds):
            (ts, ids_spec), (tk, ids_kernel) = run(spec_model, False), run(kernel_model, True)
            assert ids_spec == ids_kernel, "the kernel changed the tokens"
            if r:
                times[False].append(ts)
                times[True].append(tk)
    ratios = [a / b for a, b in zip(times[False], times[True])]
    spec, kern = statistics.median(times[False]), statistics.median(times[True])
    print(f"large model, {args.rows} rows, AR, {args.threads} thread(s), {args.rounds} rounds (medians): spec ops "
          f"{spec:.2f} s, recurrent_step_ {kern:.2f} s, {spec / kern:.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}); "
          "tokens equal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
