"""Where a decode's time goes: model forwards vs everything else, ar against low_confidence.

    python bench/update.py decode-breakdown -- python bench/decode_breakdown.py --threads 1

The shipped default model decodes the held-out task prompts (as `clover tune` does: one at a time,
greedy, to EOS or the task's budget) with ar and with low_confidence at --block / --threshold, the
modes alternating round by round (medians). Every runner call is timed, so each mode's time splits
into model forwards (prefill chunks included) and host work (engine set-up, bookkeeping, sampling,
the fill policy). The last columns give the tokens/s each mode would reach with no host work at
all, and lc's ratio to ar then: the ceiling that faster bookkeeping alone could reach. The second
table lists each mode's forwards by shape (columns fed, of them draft columns), per round.

    python bench/update.py decode-breakdown-bf16 -- python bench/decode_breakdown.py --threads 1 --linear-dtypes float32,bfloat16

runs both modes with each dtype of the compiled runner's linears (`--linear-dtype`; bfloat16: bf16
activations where the CPU multiplies bf16, ops/linear/tiled.py), all four decodes interleaved per
round. Every row has its task accuracy (exact match, as `clover tune` scores it).

The last table puts each mode at the hardware's floor: every forward costs max(weight bytes it reads /
measured copy bandwidth, weight FLOPs / measured fp32 GEMM rate) (bench/step.py's forward_floor:
every column runs the layers, the last layer's output projection, MLP and the head run only for the
columns whose logits are kept; experts read in the share their tokens can route to), with no host work. Block diffusion wins where a forward's cost hardly grows with its columns; the floor says
how much it can win on this machine at the measured tokens per forward, whatever the code.

The last line asks the other question: what if the model were perfect? low_confidence with every block
filled by its first forward (tokens per forward = B, the most any model can give at block B: each
prompt's first forward is its prefill's tail with the first window, as measured, and each further
forward commits the last block with the next window, 2B columns), at the measured cost of those
forwards, with lc's measured host time per forward. No model trained for block B can beat it on this
machine unless its forwards get cheaper.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from clover.api import encode, eos_ids, load
from clover.data.tasks import plain_prompt
from clover.engine import runner as runner_module
from clover.engine import tuning
from clover.eval import pareto
from clover.ops.linear import tiled
from step import bandwidth, forward_floor, gemm_rate, weight_itemsize  # bench/step.py: the floor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runner", default="compiled", choices=runner_module.RUNNERS)
    p.add_argument("--block", type=int, default=4)  # what `clover tune --runner compiled` chose here (BENCHMARKS.md)
    p.add_argument("--threshold", type=float, default=0.8)
    p.add_argument("--per-task", type=int, default=0, help="prompts per task (default 0: all 280)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--linear-dtypes", default="float32", help="linear dtypes to interleave, e.g. float32,bfloat16")
    args = p.parse_args()
    dtypes = args.linear_dtypes.split(",")
    if any(x not in tiled.LINEAR_DTYPES for x in dtypes):
        p.error(f"--linear-dtypes: each of {', '.join(tiled.LINEAR_DTYPES)}")
    torch.set_num_threads(args.threads)
    model, tokenizer = load(None, "cpu")
    exs = pareto.examples(args.per_task)
    jobs = [(encode(tokenizer, plain_prompt(ex)), ex["budget"]) for ex in exs]
    eos = eos_ids(model, tokenizer)
    modes = {"ar": ("ar", 1, args.threshold), "low_confidence": ("low_confidence", args.block, args.threshold)}
    settings = {(f"{name} ({x})" if len(dtypes) > 1 else name): (x, s) for x in dtypes for name, s in modes.items()}

    lengths: dict = {}  # mode -> tokens of each prompt's output (the same every round: greedy)

    def score(i, ids):  # the task suite's exact match of the output's stripped first line (clover tune's)
        lengths.setdefault(current[0], {})[i] = len(ids)
        return tokenizer.decode(ids, skip_special_tokens=True).strip().split("\n")[0].strip() == exs[i]["answer"]

    calls: dict = collections.defaultdict(list)  # (mode, columns, draft columns) -> seconds of each call
    spent = collections.defaultdict(float)  # this round's seconds inside runner calls
    current = [""]
    cls = runner_module.CompiledRunner if args.runner == "compiled" else runner_module.EagerRunner
    real = cls.forward

    def timed(self, ids, cache, **kw):
        start = time.perf_counter()
        out = real(self, ids, cache, **kw)
        seconds = time.perf_counter() - start
        spent[current[0]] += seconds
        calls[(current[0], ids.shape[1], kw.get("draft_len", 0), out.shape[1])].append(seconds)
        return out

    runs = {name: [] for name in settings}
    with torch.inference_mode():
        for setting in modes.values():  # compile (or load) every shape first: not decode time
            tuning.decode_rate(model, jobs, eos, *setting, args.runner)
        cls.forward = timed
        try:
            for _ in range(args.rounds):
                for name, (dtype, setting) in settings.items():
                    tiled.use_bf16_activations(dtype == "bfloat16")  # read per call: no recompile
                    current[0], spent[name] = name, 0.0
                    r = tuning.decode_rate(model, jobs, eos, *setting, args.runner, score)
                    runs[name].append(dict(r, in_forwards=spent[name]))
        finally:
            cls.forward = real
            tiled.use_bf16_activations(False)

    print(f"Default model, {len(jobs)} held-out task prompts one at a time, greedy, {args.runner} runner, "
          f"{tuning.machine_key('cpu', args.threads)}, median of {args.rounds} alternating rounds; ms per round (all prompts)\n")
    print("| mode | B / threshold | tokens | forwards | TPF | accuracy | ms | in forwards | host | tokens/s | vs ar "
          "| tokens/s, forwards only | vs ar, forwards only |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for name, rs in runs.items():
        total = statistics.median(r["seconds"] for r in rs)
        fwd = statistics.median(r["in_forwards"] for r in rs)
        rows[name] = (rs[-1]["tokens"], rs[-1]["forwards"], total, fwd, rs[-1]["accuracy"])
    first = next(iter(rows))  # ar with the first dtype: every ratio is against it
    ar_tokens, _, ar_total, ar_fwd, _ = rows[first]
    for name, (tokens, forwards, total, fwd, accuracy) in rows.items():
        b, t = settings[name][1][1:]
        label = "-" if name.startswith("ar") else f"{b} / {t}"
        print(f"| {name} | {label} | {tokens} | {forwards} | {tokens / forwards:.2f} | {accuracy:.3f} | {1e3 * total:.1f} | "
              f"{1e3 * fwd:.1f} | {1e3 * (total - fwd):.1f} | {tokens / total:.0f} | "
              f"{(tokens / total) / (ar_tokens / ar_total):.2f}x | {tokens / fwd:.0f} | "
              f"{(tokens / fwd) / (ar_tokens / ar_fwd):.2f}x |")
    if len(dtypes) > 1:
        print(f"\nvs ar: against {first}. With one linear dtype, low_confidence / ar: " + ", ".join(
            f"{x} {(rows[f'low_confidence ({x})'][0] / rows[f'low_confidence ({x})'][2]) / (rows[f'ar ({x})'][0] / rows[f'ar ({x})'][2]):.2f}x"
            for x in dtypes) + ".")

    print("\nForwards by shape, per round: columns fed (clean + draft; a compiled runner may left-pad the clean part "
          "to a graph's width, compile.bucket), columns whose logits come out, median ms per call, and "
          "the floor of that forward\n")
    print("| mode | columns | of them draft | logits | calls | ms each | floor ms | ms per round |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    bw, rate, itemsize = bandwidth(), gemm_rate(), weight_itemsize(model)
    floor = forward_floor(model, itemsize, bw, rate)
    at_floor = collections.defaultdict(float)  # mode -> seconds per round at the floor
    for (name, width, draft, kept), secs in sorted(calls.items()):
        at_floor[name] += len(secs) / args.rounds * floor(width, kept)
        print(f"| {name} | {width} | {draft} | {kept} | {len(secs) / args.rounds:g} | {1e3 * statistics.median(secs):.2f} | "
              f"{1e3 * floor(width, kept):.2f} | {1e3 * sum(secs) / args.rounds:.1f} |")

    print(f"\nAt the floor (copy bandwidth {bw / 1e9:.1f} GB/s, fp32 GEMM {rate / 1e9:.1f} GFLOP/s, "
          f"{itemsize} bytes a weight; every forward above at its floor, no host work)\n")
    print("| mode | tokens | floor ms per round | tokens/s at the floor | vs ar | measured / floor |")
    print("|---|---:|---:|---:|---:|---:|")
    ar_floor = ar_tokens / at_floor[first]
    for name, (tokens, _, total, _, _) in rows.items():
        print(f"| {name} | {tokens} | {1e3 * at_floor[name]:.1f} | {tokens / at_floor[name]:.0f} | "
              f"{(tokens / at_floor[name]) / ar_floor:.2f}x | {total / at_floor[name]:.1f}x |")
    for name, (tokens, forwards, total, fwd, _) in rows.items():
        if not name.startswith("low_confidence"):
            continue
        mine = {(w, d, k): secs for (n, w, d, k), secs in calls.items() if n == name}
        p = perfect(args.block, forwards, total, fwd, mine, lengths[name], args.rounds, floor, at_floor[name])
        if p is None:
            continue
        print(f"\nIf the model were perfect: {name} at block {args.block} with every block filled by its first forward: "
              f"{tokens} tokens in {p['forwards']} forwards (TPF {tokens / p['forwards']:.2f}, measured "
              f"{tokens / forwards:.2f}), {1e3 * p['step']:.2f} ms per {2 * args.block}-column step as measured, host "
              f"time per forward as measured: {1e3 * p['seconds']:.1f} ms per round, {tokens / p['seconds']:.0f} "
              f"tokens/s, {(tokens / p['seconds']) / (ar_tokens / ar_total):.2f}x ar; every forward at its floor: "
              f"{(tokens / p['at_floor']) / ar_floor:.2f}x ar at the floor.")


def perfect(B, forwards, total, fwd, calls, lengths, rounds, floor, lc_floor):
    """low_confidence's time per round if every block were filled by its first forward (the module doc).
    `calls`: (columns, draft columns, logits) -> seconds of each call over `rounds` rounds, of a decode of
    `forwards` forwards per round taking `total` seconds, `fwd` of them in forwards, `lc_floor` at the
    floor (`floor(columns, logits)`: seconds); `lengths`: tokens of each prompt's output. The decode's
    steady steps (all but each prompt's first forward: B columns within a block, 2B when one commits)
    are replaced by those a perfect model needs, ceil(tokens / B) - 1 a prompt, each 2B columns at the
    median measured cost; host time scales with forwards. None without a measured 2B-column step."""
    steady = {w: [s for (width, draft, _), secs in calls.items() if width == w and draft == B for s in secs]
              for w in (B, 2 * B)}
    if not steady[2 * B]:
        return None
    cost = {w: statistics.median(s) if s else 0.0 for w, s in steady.items()}
    kept = next(k for (width, draft, k) in calls if width == 2 * B and draft == B)
    prompts = len(lengths)
    n_b = len(steady[B]) / rounds  # B-column steps are all steady; the other steady steps are 2B wide
    n_2b = forwards - prompts - n_b
    ideal = sum(-(-n // B) for n in lengths.values())  # the first of each prompt's forwards: as measured
    step_floor = {w: floor(w, kept) for w in (B, 2 * B)}
    seconds = (fwd + (ideal - prompts) * cost[2 * B] - n_b * cost[B] - n_2b * cost[2 * B]
               + (total - fwd) * ideal / forwards)
    at_floor = lc_floor + (ideal - prompts) * step_floor[2 * B] - n_b * step_floor[B] - n_2b * step_floor[2 * B]
    return dict(forwards=ideal, step=cost[2 * B], seconds=seconds, at_floor=at_floor)


if __name__ == "__main__":
    main()
