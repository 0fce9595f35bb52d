"""Long context: prefill seconds, peak RSS and decode step ms at 1K, 8K, 32K (and 128K) tokens.

    python bench/long_context.py [--contexts 1024,8192,32768] [--slow] [--threads 1] [--steps 8] [--repeats 3]

Random weights (seed 0) at the shipped default model's dims with a 131072-token limit. Each context
runs in a fresh process (so its peak RSS is its own): the prompt is prefilled as the engine does it
(chunks of `DecodeConfig.prefill_chunk` tokens, whole windows of the block size, eager runner), then
--steps decode steps after it, each timed alone from the same cache: an AR step (1 token) and a
draft step of one block (block size 8, nothing committed). `--slow` adds 128K (131072 - 64 tokens,
room for the steps). Peak RSS is the process's high-water mark after the model is built and after
the prefill; the attention layers' K/V grow with the context, the GDN layers' state does not. The
longest prefill chunk is what a server's running rows wait for per turn while the prompt prefills
beside them. Every context runs --repeats times, in rounds over the contexts; a shared machine's
noise only slows a run, so each time is the fastest run's.
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


def one(context: int, steps: int) -> dict:
    """Prefill `context` tokens, then time the steps; every figure of one table row."""
    import torch

    from clover.api import DEFAULT_MODEL
    from clover.engine import DecodeConfig
    from clover.models import CloverConfig, CloverForBlockDiffusion

    torch.manual_seed(0)
    config = CloverConfig.from_pretrained(DEFAULT_MODEL)
    config.max_position_embeddings = LIMIT
    model = CloverForBlockDiffusion(config).eval()
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,8192,32768", help="comma-separated context lengths in tokens")
    ap.add_argument("--slow", action="store_true", help="add 128K (131072 - 64 tokens)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps of each kind (the first is a warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every context (rounds over the contexts); "
                                                          "each time is the fastest run's, RSS the highest")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process: one context, JSON out
    args = ap.parse_args(argv)
    try:
        contexts = [int(x) for x in args.contexts.split(",")] + ([LIMIT - 64] if args.slow else [])
        if any(c < 1 or c > LIMIT - 2 * BLOCK for c in contexts) or min(args.steps, args.threads, args.repeats) < 1:
            raise ValueError
    except ValueError:
        ap.exit(2, f"bench/long_context.py: contexts are 1 to {LIMIT - 2 * BLOCK} tokens, --steps, --threads and "
                   "--repeats >= 1\n")
    if args.one is not None:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(one(args.one, args.steps)))
        return 0
    rows = measure(contexts, args)
    if rows is None:
        return 1
    print(f"`python bench/long_context.py --contexts {args.contexts}{' --slow' if args.slow else ''} --threads "
          f"{args.threads} --steps {args.steps} --repeats {args.repeats}`: random weights at the default model's "
          f"dims, {LIMIT}-token limit, eager, {os.cpu_count()} CPU cores; prefill in the engine's chunks, steps "
          f"after it (median of {args.steps - 1 or 1}); every context run {args.repeats} times in fresh processes, "
          "rounds over the contexts, times of the fastest run (the machine is shared), the highest load seen.\n")
    print("| context tokens | prefill s | prefill tokens/s | longest chunk ms | peak RSS MB | RSS over the model MB "
          f"| AR step ms | {BLOCK}-token draft step ms | load avg |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context']} | {r['prefill_s']:.2f} | {r['context'] / r['prefill_s']:.0f} | {r['chunk_ms']:.0f} | "
              f"{r['rss_mb']:.0f} | {r['rss_mb'] - r['rss_model_mb']:.0f} | {r['ar_ms']:.2f} | {r['draft_ms']:.2f} | "
              f"{r['load']:.1f} |")
    print(growth(rows))
    return 0


def measure(contexts: list[int], args) -> list[dict] | None:
    """Every context `--repeats` times, each run a child process; per context the fastest time of each
    kind, the RSS of the run with the highest and the highest load. None (after a line on stderr) when a run fails."""
    runs: dict[int, list[dict]] = {c: [] for c in contexts}
    for _ in range(args.repeats):
        for c in contexts:
            out = subprocess.run([sys.executable, __file__, "--one", str(c), "--steps", str(args.steps), "--threads",
                                  str(args.threads)], capture_output=True, text=True)
            if out.returncode:
                print(f"bench/long_context.py: context {c} failed: {out.stderr.strip().splitlines()[-1:]}",
                      file=sys.stderr)
                return None
            runs[c].append(json.loads(out.stdout.strip().splitlines()[-1]) | {"load": os.getloadavg()[0]})
    rows = []
    for c, rs in runs.items():
        row = dict(max(rs, key=lambda r: r["rss_mb"]))  # its RSS figures: the highest run's
        row.update({k: min(r[k] for r in rs) for k in ("prefill_s", "chunk_ms", "ar_ms", "draft_ms")})
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
