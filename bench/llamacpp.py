"""Step times of stock llama.cpp (an exported GGUF, llama-cpp-python's low-level API) against our
PyTorch step at the same dims (eager, and the compiled runner replaying its captured graphs), and
greedy decoding speed on the sample prompts.

    python bench/llamacpp.py [--repeats 20] [--context 256] [--threads 1 2]

Needs the `make llamacpp` build. Every candidate of one table runs alternately (A B C A B C ...,
clover.utils.timing), so load from other processes hits all alike; each cell is the median, with
the floor (fastest run) beside it. Block steps are all-logits decodes of B tokens after a cached
prefix: for llama.cpp on a scratch sequence copied from the committed one (untimed), for Clover the
draft-window forward (not committed). llama.cpp runs with its defaults (f16 K/V, flash attention auto).
On a CPU with bf16 products the decode table also has the compiled runner with bf16 activations in
its linears (`--linear-dtype bfloat16`): the precision of llama.cpp's own bf16 matmuls.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from clover.api import DEFAULT_MODEL, load
from clover.backends.gguf_export import export_gguf
from clover.backends.llamacpp import LlamaCppContext, find_build, greedy_ar
from clover.backends.llamacpp.model import LlamaCppModel
from clover.engine.runner import make_runner
from clover.models import CloverForBlockDiffusion, preset_config
from clover.ops.linear import tiled
from clover.utils.timing import time_alternately

BLOCKS = (8, 16, 32)


def timed(fn, samples: list):
    def run():
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return run


def models(tmp: Path):
    """(label, model folder): the shipped default model and a random clover-small (8 layers, 16 experts)."""
    yield "default (hidden 256, 4 layers, 8 experts)", DEFAULT_MODEL
    small = tmp / "clover-small"
    torch.manual_seed(0)
    CloverForBlockDiffusion(preset_config("clover-small")).save_pretrained(small)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_MODEL / f, small / f)
    yield "clover-small (hidden 256, 8 layers, 16 experts)", small


def step_table(label, folder, tmp, args):
    files = {}
    for outtype in ("f32", "bf16", "q4_0"):
        files[outtype] = tmp / f"{folder.name}-{outtype}.gguf"
        export_gguf(folder, files[outtype], outtype)
    model, _ = load(folder, "cpu")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, vocab, (1, args.context), generator=g)
    step_ids = torch.randint(2, vocab, (1, max(BLOCKS)), generator=g)
    print(f"\n**{label}**, cached prefix of {args.context} tokens; ms per step, median (floor)\n")
    head = ["threads", "clover torch f32 AR"] + [f"clover torch f32 {b}-tok" for b in BLOCKS]
    head += ["clover compiled f32 AR"] + [f"clover compiled f32 {b}-tok" for b in BLOCKS]
    for t in files:
        head += [f"stock llama.cpp {t} AR"] + [f"stock llama.cpp {t} {b}-tok" for b in BLOCKS]
    for t in ("f32", "bf16"):
        head += [f"our llama.cpp runner {t} AR"] + [f"our llama.cpp runner {t} {b}-tok draft" for b in BLOCKS]
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        cache = model.new_cache(1, capacity=args.context + 2 * max(BLOCKS))
        with torch.inference_mode():
            model(prefix, cache=cache)
        snap = cache.snapshot()
        cands, samples, setups = {}, {}, {}

        def add(name, fn, setup=None):
            samples[name] = []
            cands[name] = timed(fn, samples[name])
            if setup:
                setups[name] = setup

        one = step_ids[:, :1]
        add("torch AR", lambda: model(one, cache=cache), lambda: cache.restore(snap))
        for b in BLOCKS:
            blk = step_ids[:, :b]
            add(f"torch {b}", lambda blk=blk, b=b: model(blk, cache=cache, block_size=b, draft_len=b))
        compiled = make_runner("compiled", model)  # captured per shape, then replayed without dynamo
        ccache = compiled.new_cache(1, args.context + 2 * max(BLOCKS))
        with torch.inference_mode():
            model(prefix, cache=ccache)
        csnap = ccache.snapshot()
        cfns = [(lambda: compiled.forward(one, ccache, logits_to_keep=1))]
        cfns += [(lambda b=b: compiled.forward(step_ids[:, :b], ccache, block_size=b, draft_len=b, clean_block_size=b, logits_to_keep=b))
                 for b in BLOCKS]
        with torch.inference_mode():
            for fn in cfns:  # the first call compiles (or loads inductor's cache), the second captures the replay
                for _ in range(2):
                    fn()
                    ccache.restore(csnap)
        add("compiled AR", cfns[0], lambda: ccache.restore(csnap))
        for b, fn in zip(BLOCKS, cfns[1:]):
            add(f"compiled {b}", fn, lambda: ccache.restore(csnap))
        cpps = {}
        for t, path in files.items():
            cpp = cpps[t] = LlamaCppContext(path, rows=2, threads=threads, n_ctx=args.context + 2 * max(BLOCKS))
            cpp.decode([prefix[0].tolist(), []], logits="last")
            toks = step_ids[0].tolist()
            add(f"{t} AR", lambda cpp=cpp: cpp.decode([[], toks[:1]], logits="all"), lambda cpp=cpp: cpp.fork(0, 1))
            for b in BLOCKS:
                add(f"{t} {b}", lambda cpp=cpp, b=b: cpp.decode([[], toks[:b]], logits="all"), lambda cpp=cpp: cpp.fork(0, 1))
        runners = []
        for t in ("f32", "bf16"):  # our runner (patched llama.cpp, llama.cpp's default settings) on the same files
            runner = LlamaCppModel(files[t], model.config, max_rows=2, threads=threads, n_ctx=args.context + 4 * max(BLOCKS))
            runners.append(runner)
            base, live = runner.new_cache(1), runner.new_cache(1)
            runner(prefix, cache=base, logits_to_keep=1)
            add(f"runner {t} AR", lambda r=runner, c=live: r(one, cache=c, logits_to_keep=1),
                lambda r=runner, b=base, c=live: r.cpp.fork(b.seqs[0], c.seqs[0]))
            for b in BLOCKS:
                blk = step_ids[:, :b]
                add(f"runner {t} {b}", lambda r=runner, c=base, blk=blk, b=b: r(blk, cache=c, block_size=b, draft_len=b,
                                                                                 logits_to_keep=b))
        with torch.inference_mode():
            time_alternately(cands, repeats=args.repeats, warmup=3, setup=lambda name: setups.get(name, lambda: None)())
        for cpp in cpps.values():
            cpp.close()
        for runner in runners:
            runner.close()
        cells = [f"{statistics.median(s[3:]) * 1e3:.2f} ({min(s[3:]) * 1e3:.2f})" for s in samples.values()]
        rows.append([str(threads)] + cells)
    # one table per thread count would be wide either way: transpose (candidates as rows)
    print("| step | " + " | ".join(f"{r[0]} thread{'s' if r[0] != '1' else ''}" for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for i, name in enumerate(head[1:]):
        print(f"| {name} | " + " | ".join(r[i + 1] for r in rows) + " |")


def versus(rounds: list[float], base: list[float]) -> dict:
    """A candidate's tokens/s over rounds against the baseline's: its median, its spread (min, max)
    and one kind of ratio, the ratio of the two medians (so the ratio column is the quotient of the
    table's own tokens/s column)."""
    median = statistics.median(rounds)
    return dict(median=median, lo=min(rounds), hi=max(rounds), ratio=median / statistics.median(base))


def bf16_linears(fn):
    """fn run with the tiled kernels' bf16 activations (`--linear-dtype bfloat16`), off again after."""
    def go():
        was = tiled.use_bf16_activations(True)
        try:
            return fn()
        finally:
            tiled.use_bf16_activations(was)
    return go


def decode_table(tmp, args):
    """Greedy tokens/s and tokens per forward on the held-out task prompts (one at a time, each to
    EOS or its task's answer budget): Clover's modes on PyTorch and on our llama.cpp runner, and
    stock llama.cpp's AR decode of the same bf16 file; per thread count, all candidates interleaved
    round by round: each one's median tokens/s, its min - max over the rounds, and the ratio of its
    median to stock AR's (`versus`)."""
    import dataclasses
    import os

    from clover.api import encode, eos_ids
    from clover.data.tasks import plain_prompt
    from clover.engine import DecodeConfig, Engine
    from clover.eval import pareto

    model, tok = load(DEFAULT_MODEL, "cpu")
    exs = pareto.examples(args.per_task)
    jobs = [(encode(tok, plain_prompt(ex)), ex["budget"]) for ex in exs]
    eos = eos_ids(model, tok)
    bf16 = tmp / "default-bf16.gguf"
    runner = LlamaCppModel(bf16, model.config, max_rows=1, threads=1)
    cpp = LlamaCppContext(bf16, threads=1)
    modes = [("ar", 1), ("low_confidence", 2), ("low_confidence", 4), ("low_confidence", 8), ("low_confidence", 16), ("low_confidence", 32),
             ("self_spec", 8)]

    def clover_run(m, mode, bs, runner_kind="eager", threshold=DecodeConfig.threshold):
        def go():
            cfg = DecodeConfig(mode=mode, block_size=bs, threshold=threshold, eos_token_ids=eos, runner=runner_kind)
            toks = fwd = 0
            for ids, budget in jobs:
                seq = Engine(m, dataclasses.replace(cfg, max_new_tokens=budget)).generate([ids])[0]
                toks, fwd = toks + len(seq.token_ids), fwd + seq.forward_passes
            return toks, fwd
        return go

    def stock_run():
        toks = 0
        for ids, budget in jobs:
            toks += len(greedy_ar(cpp, ids, budget, eos))
        return toks, toks

    stock = ("stock llama.cpp bf16", "ar", 1)
    runs = {stock: stock_run}
    runs.update({("our llama.cpp runner bf16", m, b): clover_run(runner, m, b) for m, b in modes})
    runs[("PyTorch f32 eager", "ar", 1)] = clover_run(model, "ar", 1)
    runs[("PyTorch f32 eager", "low_confidence", 16)] = clover_run(model, "low_confidence", 16)
    compiled = [("ar", 1, None), ("low_confidence", 8, None), ("low_confidence", 16, None)]
    compiled += [("low_confidence", int(b), float(t)) for b, t in (x.split("/") for x in args.tuned)]
    for m, b, t in compiled:  # the announced threshold, and the tuned settings (`clover tune`) given by --tuned
        key = ("PyTorch f32 compiled", m, b if t is None else f"{b} / {t}")
        runs[key] = go = clover_run(model, m, b, "compiled", DecodeConfig.threshold if t is None else t)
        with torch.inference_mode():
            go()  # compiles (or loads inductor's cache) every shape these prompts need, before the timed rounds
    if tiled.available() and tiled.bf16_dot():  # bf16 activations in the linears, as llama.cpp's bf16 matmuls
        for m, b, t in [compiled[0]] + compiled[3:]:  # the same graphs: the kernels read the setting per call
            key = ("PyTorch compiled, bf16 linears", m, b if t is None else f"{b} / {t}")
            runs[key] = bf16_linears(clover_run(model, m, b, "compiled", DecodeConfig.threshold if t is None else t))
    for threads in args.threads:
        torch.set_num_threads(threads)
        cpp.set_threads(threads)
        runner.cpp.set_threads(threads)
        load_before = os.getloadavg()[0]
        results = {k: [] for k in runs}
        for _ in range(args.decode_repeats):
            for k, fn in runs.items():
                start = time.perf_counter()
                with torch.inference_mode():
                    toks, fwd = fn()
                results[k].append((toks / (time.perf_counter() - start), toks / max(fwd, 1)))
        print(f"\n**Greedy decoding, shipped default model, {len(jobs)} held-out task prompts ({args.per_task} per task) "
              f"one at a time, to EOS or the task's budget, {threads} thread{'s' if threads > 1 else ''}** (median of "
              f"{args.decode_repeats} interleaved rounds; load average {load_before:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after, on the machine's {os.cpu_count()} cores)\n")
        print("| decoder | mode | B | tokens/s | tokens/s min - max over rounds | vs stock AR (ratio of medians) "
              "| tokens per forward |")
        print("|---|---|---:|---:|---:|---:|---:|")
        base = [s[0] for s in results[stock]]
        for (name, mode, bs), rs in results.items():
            m = versus([r[0] for r in rs], base)
            print(f"| {name} | {mode} | {bs} | {m['median']:.1f} | {m['lo']:.1f} - {m['hi']:.1f} | {m['ratio']:.2f}x "
                  f"| {rs[-1][1]:.2f} |")
        tpf = {bs: rs[-1][1] for (name, mode, bs), rs in results.items() if name.startswith("our") and mode == "low_confidence"}
        bound_table(bf16, jobs, tpf, threads, args.repeats)
    cpp.close()
    runner.close()


def bound_table(gguf: Path, jobs, tpf: dict, threads: int, repeats: int) -> None:
    """The most low_confidence could gain on this CPU with llama.cpp's own kernels. t(n): stock
    llama.cpp's forward of n tokens (causal, all logits: no block-mode extra) after a prefix of the
    task prompts' median length, decode call only, the graph reused as in an AR loop. Decoding a
    block of B tokens at TPF tau takes B/tau forwards of B tokens, and committing the block adds B positions: at best folded into the next
    block's first forward, for t(2B) - t(B). So per token, lc needs at least
    ((B/tau) t(B) + t(2B) - t(B)) / B, and t(2B) / B even at tau = B (a whole block per forward);
    AR needs t(1). Prefill and Python are left out of both, which only favours lc."""
    context = sorted(len(ids) for ids, _ in jobs)[len(jobs) // 2]
    sizes = sorted({1, *(b for b in tpf), *(2 * b for b in tpf)})
    toks = list(range(10, 10 + max(sizes)))
    prefix = [10 + i % 1000 for i in range(context)]
    cpp = LlamaCppContext(gguf, threads=threads)
    t = {}
    for n in sizes:  # forwards of n tokens one after another on one sequence (llama.cpp reuses the graph), as
        samples = []  # an AR loop runs; from the prefix again every 8, so the context stays near the prompts'
        for _ in range(max(repeats, 8) // 8 + 1):
            cpp.reset()
            cpp.decode([prefix], "last")
            cpp.decode([toks[:n]], logits="all")  # untimed: builds the graph for n tokens
            for _ in range(8):
                start = time.perf_counter()
                cpp.decode([toks[:n]], logits="all")
                samples.append(time.perf_counter() - start)
        t[n] = 1e3 * statistics.median(samples)
    cpp.close()
    print(f"\n**The ceiling of low_confidence on llama.cpp's kernels, {threads} thread{'s' if threads > 1 else ''}**: stock "
          f"llama.cpp bf16 forward of n tokens after {context} cached tokens (the prompts' median), t(1) = {t[1]:.3f} ms "
          f"= {1e3 / t[1]:.0f} AR tokens/s at most. lc tokens/s at most: B / ((B/TPF) t(B) + t(2B) - t(B)), with the "
          "TPF measured above, and with TPF = B (a whole block per forward)\n")
    print("| B | t(B) ms | t(2B) ms | TPF | lc tokens/s at most | vs AR's | at TPF = B | vs AR's |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b, tau in sorted(tpf.items()):
        best = b / ((b / tau) * t[b] + t[2 * b] - t[b]) * 1e3
        ideal = b / t[2 * b] * 1e3
        print(f"| {b} | {t[b]:.3f} | {t[2 * b]:.3f} | {tau:.2f} | {best:.0f} | {best * t[1] / 1e3:.2f}x | {ideal:.0f} "
              f"| {ideal * t[1] / 1e3:.2f}x |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--per-task", type=int, default=2, help="task prompts per synthetic task (default 2)")
    ap.add_argument("--decode-repeats", type=int, default=3, help="interleaved rounds of the decode table")
    ap.add_argument("--decode-only", action="store_true", help="only the decode table (no step tables)")
    ap.add_argument("--tuned", nargs="*", default=["4/0.8"], metavar="B/THRESHOLD",
                    help="extra compiled low_confidence settings for the decode table, e.g. what `clover tune` chose "
                         "(default 4/0.8, its choice on all 280 task prompts here; the plain rows use the announced "
                         "threshold 0.95)")
    args = ap.parse_args()
    if find_build() is None or find_build(variant="clover") is None:
        print("bench/llamacpp.py: no llama.cpp build (make llamacpp)", file=sys.stderr)
        return 2
    print(f"`python bench/llamacpp.py --repeats {args.repeats} --context {args.context} --threads "
          f"{' '.join(map(str, args.threads))} --per-task {args.per_task} --decode-repeats {args.decode_repeats}"
          f"{' --decode-only' if args.decode_only else ''} --tuned {' '.join(args.tuned)}` "
          f"(llama.cpp from llama-cpp-python 0.3.36's sdist, torch {torch.__version__})")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.decode_only:
            export_gguf(DEFAULT_MODEL, tmp / "default-bf16.gguf", "bf16")
        else:
            for label, folder in models(tmp):
                step_table(label, Path(folder), tmp, args)
        decode_table(tmp, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
