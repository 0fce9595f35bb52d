"""A 32-row compiled AR step of bench/serve_peer.py's large random model (seed 0; int4: its RTN copy,
group 128, int8 activations) in two source trees, for kernel changes that cannot be switched within
one process (the C++ extension of each tree): processes alternate, base tree then this one, per
round and precision. Each process builds the compiled runner, prefills --rows rows of a 128-token
prompt, warms the graphs over --steps forwards, then times --steps AR forwards of one token each
(the cache growing, each row fed its own greedy pick) by --clock: `cpu`, the process's thread CPU
time (what the scheduler gave other work left out; at 1 thread the whole step), or `wall`. Prints
per precision the ratio of the medians over rounds (base / this), its per-round spread, and the share
of greedy picks the two trees agree on (fp32 should be 100%; int4's int8 activation rounding turns
a last-bit difference into a flipped near-tie now and then, and a flipped row then feeds itself other
tokens).

    python bench/step_ab.py --base-tree /path/to/base/checkout [--base-ext /tmp/ext-base] \\
        [--precisions fp32,int4] [--rounds 3] [--steps 40] [--threads 1] [--clock cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(precision: str, threads: int, steps: int, rows: int, clock_name: str, out: str) -> None:
    """One process's run, written as json {times, picks} to `out`."""
    sys.path.insert(0, str(HERE))
    import torch

    import serve_peer
    from clover.engine.runner import make_runner
    from clover.models import CloverForBlockDiffusion
    from clover.quant.modules import quantize_rtn_in_place, set_int4_kernel

    clock = time.thread_time if clock_name == "cpu" else time.perf_counter
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(serve_peer.size_config("large")).eval()
    if precision == "int4":
        set_int4_kernel(quantize_rtn_in_place(model, 128), "int8")
    prompt = torch.randint(10, 3000, (rows, 128), generator=torch.Generator().manual_seed(0))
    times, picks = [], []
    with torch.inference_mode():
        runner = make_runner("compiled", model)
        cache = runner.new_cache(rows, 128 + steps + 8)
        model(prompt, cache=cache)
        snap, ids = cache.snapshot(), prompt[:, -1:]
        for _ in range(steps):  # every span bucket the timed steps meet, compiled (or loaded) first
            runner.forward(ids, cache, logits_to_keep=1)
        cache.restore(snap)
        for _ in range(steps):
            start = clock()
            ids = runner.forward(ids, cache, logits_to_keep=1)[:, -1:].argmax(-1)
            times.append(clock() - start)
            picks.append(ids.flatten().tolist())
    Path(out).write_text(json.dumps({"times": times, "picks": picks}))


def run_one(tree: Path, ext: str | None, args, precision: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_WAIT_POLICY": "PASSIVE"}
        if ext:
            env["TORCH_EXTENSIONS_DIR"] = ext
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", precision, "--threads", str(args.threads),
               "--steps", str(args.steps), "--rows", str(args.rows), "--clock", args.clock, "--out", out]
        subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out).read_text())


def report(precision: str, base: list[dict], mine: list[dict], args) -> str:
    b = [statistics.median(r["times"]) for r in base]
    m = [statistics.median(r["times"]) for r in mine]
    per = [x / y for x, y in zip(b, m)]
    same = min(statistics.mean(p == q for s, t in zip(x["picks"], y["picks"]) for p, q in zip(s, t))
               for x, y in zip(base, mine))
    return (f"{precision}, {args.rows} rows, {args.threads} thread(s), {args.clock} clock, {len(per)} rounds: base "
            f"{1e3 * statistics.median(b):.1f} ms, this tree {1e3 * statistics.median(m):.1f} ms per step, "
            f"{statistics.median(b) / statistics.median(m):.2f}x (rounds {min(per):.2f}-{max(per):.2f}); "
            f"greedy picks equal: {100 * same:.1f}%")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-tree", type=Path, help="a checkout of the base commit")
    ap.add_argument("--base-ext", help="TORCH_EXTENSIONS_DIR for the base tree's build (default: torch's)")
    ap.add_argument("--ext", help="TORCH_EXTENSIONS_DIR for this tree's build (default: the environment's)")
    ap.add_argument("--precisions", default="fp32,int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--worker", choices=("fp32", "int4"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.threads, args.steps, args.rows, args.clock, args.out)
        return 0
    precisions = args.precisions.split(",")
    problem = ("--base-tree must name a checkout of clover (a folder holding clover/__init__.py)"
               if args.base_tree is None or not (args.base_tree / "clover" / "__init__.py").is_file()
               else "--precisions takes fp32 and/or int4" if not set(precisions) <= {"fp32", "int4"} else None)
    if problem:
        print(f"step_ab.py: {problem}", file=sys.stderr)
        return 2
    runs = {p: ([], []) for p in precisions}
    mine = HERE.parent
    for _ in range(args.rounds):
        for p in precisions:
            runs[p][0].append(run_one(args.base_tree.resolve(), args.base_ext, args, p))
            runs[p][1].append(run_one(mine, args.ext or os.environ.get("TORCH_EXTENSIONS_DIR"), args, p))
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for p in precisions:
        print(report(p, *runs[p], args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
