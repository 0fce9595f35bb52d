"""Serving benchmark: `clover serve` in a subprocess, 1 / 4 / 16 concurrent streaming clients.

    python bench/serve.py [--model DIR] [--clients 1,4,16] [--requests 4] [--max-tokens 64] [--block-size 8] [--threads 1]

Each client is a closed loop (the official async `openai` client, streaming): it sends its next
request when the last one ends. Every request generates exactly --max-tokens (`ignore_eos`), so
levels do the same work per request. Prints a markdown table: aggregate generated tokens/s,
per-request latency p50 / p99 and time to first block p50, and the 16-vs-1 throughput ratio
(target: >= 4x, from continuous batching). --model defaults to the shipped default model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Shall I compare thee", "Now is the winter of", "To be, or not to be", "Friends, Romans,",
           "All the world's a stage", "If music be the food", "Once more unto the breach", "O Romeo, Romeo"]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def client_loop(c, model: str, cid: int, requests: int, max_tokens: int, results: list):
    for r in range(requests):
        t0 = time.perf_counter()
        first, tokens = None, 0
        stream = await c.completions.create(model=model, prompt=PROMPTS[(cid + r) % len(PROMPTS)], max_tokens=max_tokens,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - t0
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        results.append((time.perf_counter() - t0, first or 0.0, tokens))


async def level(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    import openai

    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    results: list = []
    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(c, model, i, requests, max_tokens, results) for i in range(clients)))
    wall = time.perf_counter() - t0
    await c.close()
    lat, ttfb, toks = zip(*results)
    return dict(clients=clients, requests=len(results), tokens=sum(toks), wall=wall, tps=sum(toks) / wall,
                p50=percentile(lat, 0.5), p99=percentile(lat, 0.99), ttfb=percentile(ttfb, 0.5))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model folder (default: the shipped default model)")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8,
                    help="default 8: the shipped model fills ~1 token per step, so wider blocks only add compute")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=1, help="server torch threads")
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]

    cmd = [sys.executable, "-m", "clover", "serve", "--port", "0", "--threads", str(args.threads),
           "--block-size", str(args.block_size), "--threshold", str(args.threshold),
           "--max-batch", str(max(levels)), "--served-model-name", "bench"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        url = None
        for line in proc.stdout:
            match = re.search(r"on (http://\S+)", line)
            if match:
                url = match.group(1)
                break
        if url is None:
            print("bench/serve.py: the server did not start", file=sys.stderr)
            return 1
        asyncio.run(level(url, "bench", 1, 1, 8))  # warm-up
        rows = [asyncio.run(level(url, "bench", n, args.requests, args.max_tokens)) for n in levels]
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    model = args.model or "the shipped default model (clover/assets/default)"
    print(f"`clover serve` on {model}, {os.cpu_count()} CPU cores (server: {args.threads} torch thread), "
          f"{args.requests} streamed requests per client, {args.max_tokens} tokens each (ignore_eos), "
          f"block size {args.block_size}, threshold {args.threshold}, greedy.\n")
    print("| clients | requests | tokens | wall s | aggregate tokens/s | latency p50 s | latency p99 s | first block p50 s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['wall']:.1f} | {r['tps']:.1f} | "
              f"{r['p50']:.2f} | {r['p99']:.2f} | {r['ttfb']:.2f} |")
    by = {r["clients"]: r for r in rows}
    if 1 in by and max(levels) > 1:
        top = by[max(levels)]
        ratio = top["tps"] / by[1]["tps"]
        print(f"\nAggregate tokens/s at {top['clients']} clients = {ratio:.1f}x one client "
              f"(target >= 4x: {'met' if ratio >= 4 else 'NOT met'}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
