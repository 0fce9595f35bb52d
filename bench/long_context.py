"""Long context: prefill seconds, peak RSS and decode step ms at 1K, 8K, 32K (and 128K) tokens.

    python bench/long_context.py [--contexts 1024,8192,32768] [--slow] [--threads 1] [--steps 8] [--repeats 3]
                                 [--stall 32768]

Random weights (seed 0) at the shipped default model's dims with a 131072-token limit. Each context
runs in a fresh process (so its peak RSS is its own): the prompt is prefilled as the engine does it
(chunks of `DecodeConfig.prefill_chunk` tokens, whole windows of the block size, eager runner), then
--steps decode steps after it, each timed alone from the same cache: an AR step (1 token) and a
draft step of one block (block size 8, nothing committed). `--slow` adds 128K (131072 - 64 tokens,
room for the steps). Peak RSS is the process's high-water mark after the model is built and after
the prefill; the attention layers' K/V grow with the context, the GDN layers' state does not. The
longest prefill chunk is what a server's running rows wait for per turn while the prompt prefills
beside them; --stall measures that gap: a stream decoding while a prompt of that many tokens joins
its engine, prefilled a chunk per step (the server) and at once. Every context runs --repeats
times, in rounds over the contexts; a shared machine's noise only slows a run, so each time is the
fastest run's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

LIMIT = 131072
BLOCK = 8


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def build():
    """The random-weight model at the default dims with the 131072-token limit."""
    import torch

    from clover.api import DEFAULT_MODEL
    from clover.models import CloverConfig, CloverForBlockDiffusion

    torch.manual_seed(0)
    config = CloverConfig.from_pretrained(DEFAULT_MODEL)
    config.max_position_embeddings = LIMIT
    return CloverForBlockDiffusion(config).eval()


def one(context: int, steps: int) -> dict:
    """Prefill `context` tokens, then time the steps; every figure of one table row."""
    import torch

    from clover.engine import DecodeConfig

    model = build()
    config = model.config
    base = rss_mb()
    ids = torch.randint(2, config.vocab_size, (1, context + BLOCK), generator=torch.Generator().manual_seed(0))
    chunk = DecodeConfig.prefill_chunk // BLOCK * BLOCK
    cache = model.new_cache(1, capacity=context + 2 * BLOCK)
    chunks = []
    with torch.inference_mode():
        cuts = [0] + list(range(context % chunk or chunk, context, chunk)) + [context]
        for a, b in zip(cuts[:-1], cuts[1:]):
            start = time.perf_counter()
            model(ids[:, a:b], cache=cache, clean_block_size=BLOCK, logits_to_keep=1)
            chunks.append(time.perf_counter() - start)
    prefill = sum(chunks)
    kv_bytes = sum(t[0, :, 0].numel() * t.element_size() for t in (*cache.key.values(), *cache.value.values()))
    after = rss_mb()
    snap = cache.snapshot()
    timings = {"ar": [], "draft": []}
    with torch.inference_mode():
        for _ in range(steps):
            for name, n, draft in (("ar", 1, 0), ("draft", BLOCK, BLOCK)):
                cache.restore(snap)
                start = time.perf_counter()
                model(ids[:, context:context + n], cache=cache, block_size=BLOCK, draft_len=draft, logits_to_keep=n)
                timings[name].append(time.perf_counter() - start)
    return dict(context=context, prefill_s=prefill, chunk=chunk, chunk_ms=1e3 * max(chunks), kv_bytes=kv_bytes,
                rss_model_mb=base, rss_mb=max(after, rss_mb()),
                ar_ms=1e3 * statistics.median(timings["ar"][1:] or timings["ar"]),
                draft_ms=1e3 * statistics.median(timings["draft"][1:] or timings["draft"]))


def stall(context: int) -> dict:
    """A stream decoding (AR) while a `context`-token prompt joins its engine: the longest gap between
    two of its tokens, with the prompt prefilled a chunk per step (`Engine.add(interleave=True)`, the
    server) and all at once (`add` alone), and the interleaved steps' median."""
    import torch

    from clover.engine import DecodeConfig, Engine

    model = build()
    cfg = DecodeConfig(mode="ar", block_size=1, max_new_tokens=context // 256 + 64)
    g = torch.Generator().manual_seed(1)
    short, long = (torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in (16, context))
    out = {}
    with torch.inference_mode():
        for interleave in (True, False):
            engine = Engine(model, cfg)
            [row] = engine.add([short])
            for _ in range(3):
                engine.step()
            gaps, last = [], time.perf_counter()
            [joining] = engine.add([long], max_new_tokens=[1], interleave=interleave)
            joined = False
            while not joined:  # up to the step whose forward carries the prompt's last chunk
                joined = any(s is joining for s in engine.seqs)
                engine.step()
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
            assert not row.finished
            out["interleaved" if interleave else "at_once"] = gaps
    steps = out["interleaved"]
    return dict(context=context, gap_ms=1e3 * max(steps), median_ms=1e3 * statistics.median(steps), steps=len(steps),
                at_once_ms=1e3 * max(out["at_once"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,8192,32768", help="comma-separated context lengths in tokens")
    ap.add_argument("--slow", action="store_true", help="add 128K (131072 - 64 tokens)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps of each kind (the first is a warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every context (rounds over the contexts); "
                                                          "each time is the fastest run's, RSS the highest")
    ap.add_argument("--stall", type=int, default=32768, help="context of the prompt that joins a decoding stream "
                                                            "(0: none)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process: one context, JSON out
    ap.add_argument("--gap", type=int, help=argparse.SUPPRESS)  # the child process: `stall`, JSON out
    args = ap.parse_args(argv)
    try:
        contexts = [int(x) for x in args.contexts.split(",")] + ([LIMIT - 64] if args.slow else [])
        if (any(c < 1 or c > LIMIT - 2 * BLOCK for c in contexts) or min(args.steps, args.threads, args.repeats) < 1
                or not 0 <= args.stall <= LIMIT // 2):
            raise ValueError
    except ValueError:
        ap.exit(2, f"bench/long_context.py: contexts are 1 to {LIMIT - 2 * BLOCK} tokens, --steps, --threads and "
                   "--repeats >= 1, --stall 0 to {LIMIT // 2}\n")
    if args.one is not None or args.gap is not None:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(stall(args.gap) if args.one is None else one(args.one, args.steps)))
        return 0
    rows = measure(contexts, args)
    gaps = measure([args.stall], args, "--gap") if args.stall else []
    if rows is None or gaps is None:
        return 1
    report(rows, gaps, args)
    return 0


def report(rows: list[dict], gaps: list[dict], args) -> None:
    print(f"`python bench/long_context.py --contexts {args.contexts}{' --slow' if args.slow else ''} --threads "
          f"{args.threads} --steps {args.steps} --repeats {args.repeats} --stall {args.stall}`: random weights at the "
          f"default model's dims, {LIMIT}-token limit, eager, {os.cpu_count()} CPU cores; prefill in the engine's "
          f"chunks, steps after it (median of {args.steps - 1 or 1}); every context run {args.repeats} times in fresh "
          "processes, rounds over the contexts, times of the fastest run (the machine is shared), the highest load "
          "seen.\n")
    print("| context tokens | prefill s | prefill tokens/s | longest chunk ms | peak RSS MB | RSS over the model MB "
          f"| AR step ms | {BLOCK}-token draft step ms | load avg |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context']} | {r['prefill_s']:.2f} | {r['context'] / r['prefill_s']:.0f} | {r['chunk_ms']:.0f} | "
              f"{r['rss_mb']:.0f} | {r['rss_mb'] - r['rss_model_mb']:.0f} | {r['ar_ms']:.2f} | {r['draft_ms']:.2f} | "
              f"{r['load']:.1f} |")
    print(growth(rows))
    for g in gaps:
        print(f"\nA stream decoding (AR) while a {g['context']}-token prompt joins its engine: the longest gap "
              f"between its tokens {g['gap_ms']:.0f} ms (median {g['median_ms']:.0f} ms over the {g['steps']} steps "
              f"the prompt takes to join) with the prompt prefilled a chunk per step beside it (the server), "
              f"{g['at_once_ms']:.0f} ms with it prefilled at once (load {g['load']:.1f}).")


def measure(contexts: list[int], args, child: str = "--one") -> list[dict] | None:
    """Every context `--repeats` times, each run a child process (`child`: --one for a table row,
    --gap for `stall`); per context the fastest run's figure of each time (*_ms, *_s), the RSS
    figures of the run with the highest and the highest load. None (after a line on stderr) when a
    run fails."""
    runs: dict[int, list[dict]] = {c: [] for c in contexts}
    for _ in range(args.repeats):
        for c in contexts:
            out = subprocess.run([sys.executable, __file__, child, str(c), "--steps", str(args.steps), "--threads",
                                  str(args.threads)], capture_output=True, text=True)
            if out.returncode:
                print(f"bench/long_context.py: context {c} failed: {out.stderr.strip().splitlines()[-1:]}",
                      file=sys.stderr)
                return None
            runs[c].append(json.loads(out.stdout.strip().splitlines()[-1]) | {"load": os.getloadavg()[0]})
    rows = []
    for c, rs in runs.items():
        row = dict(max(rs, key=lambda r: r.get("rss_mb", 0)))
        row.update({k: min(r[k] for r in rs) for k in row if k.endswith(("_ms", "_s"))})
        rows.append(row | {"load": max(r["load"] for r in rs)})
    return rows


def growth(rows: list[dict]) -> str:
    """What the table's memory column means per token: the RSS over the model added per token of
    context between each two consecutive contexts (flat or falling: linear memory), beside what the
    attention layers' K/V take per token; and what the longest chunk is."""
    rows = sorted(rows, key=lambda r: r["context"])
    over = [r["rss_mb"] - r["rss_model_mb"] for r in rows]
    slopes = [f"{(b - a) * 1024 / (rb['context'] - ra['context']):.2f} ({ra['context']} to {rb['context']})"
              for a, b, ra, rb in zip(over, over[1:], rows, rows[1:])]
    return (f"\nLongest chunk: the one prefill forward (of {rows[-1]['chunk']} tokens, the last, at the deepest "
            "context) that a server's running rows wait for per step while this prompt prefills beside them. "
            f"K/V of the attention layers: {rows[-1]['kv_bytes'] / 1024:.2f} KiB per token of context; RSS over "
            f"the model added per token, KiB: {', '.join(slopes) or '-'}.")

if __name__ == "__main__":
    sys.exit(main())
