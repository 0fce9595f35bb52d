"""A one-row compiled AR step's time against the pause before it: how much of a served step's cost
comes from the pause before it (issue 54's 1-client point).

    python bench/step_gap.py [--gaps 0,1,3] [--steps 40] [--rounds 5] [--threads 1]

The same step of the shipped default model (a cached prefix of 64 tokens, the cache restored
untimed after each step) runs in bursts of `--steps` steps, each step after a pause of one of the
gaps (a sleep); bursts of every gap alternate in rounds, so load from other processes hits all
alike. Each gap's figure is the median step over its rounds, with the range of the rounds' medians.
A server's decoding thread pauses between steps (its Python, waits for the GIL, the event loop);
a tight loop does not. The likely cause on a machine whose L3 is shared with other work: weights
that fit the cache stay there only while nothing else runs in between (not measured here).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from clover.api import DEFAULT_MODEL, load
from clover.engine.runner import make_runner


def burst(step, gap: float, steps: int) -> float:
    """The median seconds of `steps` steps, each after a pause of `gap` seconds."""
    times = []
    for _ in range(steps):
        if gap:
            time.sleep(gap)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gaps", default="0,1,3", help="pauses before each step, ms (default 0,1,3)")
    ap.add_argument("--steps", type=int, default=40, help="steps per burst (default 40)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of bursts, gaps alternating (default 5)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    gaps = [float(g) / 1e3 for g in args.gaps.split(",")]
    torch.set_num_threads(args.threads)
    model, _ = load(DEFAULT_MODEL, "cpu")
    runner = make_runner("compiled", model)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, model.config.vocab_size, (1, 64), generator=g)
    one = torch.randint(2, model.config.vocab_size, (1, 1), generator=g)
    cache = runner.new_cache(1, 128)
    with torch.inference_mode():
        model(prefix, cache=cache)
    snap = cache.snapshot()

    @torch.inference_mode()
    def step():
        runner.forward(one, cache, logits_to_keep=1)
        cache.restore(snap)

    for _ in range(3):  # compiles (or loads inductor's cache), then captures the replay
        step()
    rounds = {gap: [] for gap in gaps}
    for _ in range(args.rounds):
        for gap in gaps:
            rounds[gap].append(burst(step, gap, args.steps))
    base = statistics.median(rounds[gaps[0]])
    print(f"| pause before each step ms | one-row compiled AR step ms, default model, fp32, {args.threads} thread(s), "
          f"median of {args.rounds} bursts of {args.steps} | range of bursts ms | vs pause {gaps[0] * 1e3:g} |")
    print("|---:|---:|---:|---:|")
    for gap, meds in rounds.items():
        m = statistics.median(meds)
        print(f"| {gap * 1e3:g} | {m * 1e3:.3f} | {min(meds) * 1e3:.3f} - {max(meds) * 1e3:.3f} | {m / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
