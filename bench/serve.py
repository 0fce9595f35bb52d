"""Serving benchmark: `clover serve` in a subprocess, 1 / 4 / 16 concurrent streaming clients.

    python bench/serve.py [--model DIR] [--clients 1,4,16] [--requests 4] [--max-tokens 64] [--block-size 8] [--threads 1]
                          [--runners eager,compiled] [--rounds 3]

Each client is a closed loop (the official async `openai` client, streaming): it sends its next
request when the last one ends. Every request generates exactly --max-tokens (`ignore_eos`), so
levels do the same work per request. Prints a markdown table: aggregate generated tokens/s,
per-request latency p50 / p99 and time to first block p50, and the 16-vs-1 throughput ratio
(target: >= 4x, from continuous batching). --model defaults to the shipped default model.

`--runners eager,compiled`: one server per runner (`clover serve --runner`), both up at once; every
level runs once on each to warm up (the compiled server runs new shapes eagerly and compiles them
when idle: the bench waits for that, `clover_graphs_deferred` 0), then --rounds times on each, the
runners interleaved level by level; the table gives each runner's medians and the compiled / eager
ratio of aggregate tokens/s. Shapes first met in a timed round run eagerly in it (the table counts them).

    python bench/serve.py --structured [--model DIR] [--max-tokens 48]

`--structured`: 8 structured-output requests (response_format json_schema; a schema that infills,
then one that takes the grammar path) sent one after another, then the same 8 at once while 8 free
streams (greedy, --max-tokens each, ignore_eos) run alongside. Prints the wall time of each, the
ratio concurrent / sequential (target < 0.5: infilled requests batch in the one scheduler), and
whether the concurrent replies and the free streams equal their solo runs.
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


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}, "member": {"type": "boolean"}},
    "required": ["name", "age", "city", "member"]}
GRAMMAR = {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "integer"}]}
ASKS = ["Describe a person as JSON.", "Who lives in Rome?", "Invent a club member.", "Name someone from Oslo.",
        "A traveller, please.", "Give me a profile.", "Someone aged 40?", "Tell me about a neighbour."]


async def structured_request(c, model: str, ask: str, schema: dict) -> tuple[str, dict]:
    r = await c.chat.completions.create(model=model, messages=[{"role": "user", "content": ask}], max_tokens=160,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "reply", "schema": schema}})
    return r.choices[0].message.content, r.model_extra["clover"]["structured"][0]


async def free_stream(c, model: str, prompt: str, max_tokens: int) -> str:
    r = await c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True})
    return r.choices[0].text


async def structured_case(url: str, model: str, schema: dict, max_tokens: int) -> dict:
    import openai

    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    solo_free = [await free_stream(c, model, p, max_tokens) for p in PROMPTS]
    t0 = time.perf_counter()
    sequential = [await structured_request(c, model, a, schema) for a in ASKS]
    t_seq = time.perf_counter() - t0
    free = [asyncio.create_task(free_stream(c, model, p, max_tokens)) for p in PROMPTS]
    t0 = time.perf_counter()
    concurrent = await asyncio.gather(*(structured_request(c, model, a, schema) for a in ASKS))
    t_conc = time.perf_counter() - t0
    free_out = await asyncio.gather(*free)
    await c.close()
    return dict(method=sequential[0][1]["method"], seq=t_seq, conc=t_conc, ratio=t_conc / t_seq,
                same=list(concurrent) == sequential, free_same=free_out == solo_free,
                valid=sum(info["valid"] for _, info in concurrent))


def served(args, max_batch: int, work, runner: str = "eager"):
    """`work(url)` against `clover serve` in a subprocess (after a warm-up request); None when the
    server did not start."""
    proc, url = start_server(args, max_batch, runner)
    try:
        if url is None:
            print("bench/serve.py: the server did not start", file=sys.stderr)
            return None
        asyncio.run(level(url, "bench", 1, 1, 8))  # warm-up
        return work(url)
    finally:
        stop_server(proc)


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(args, max_batch: int, runner: str = "eager", root=ROOT):
    """`clover serve` in a subprocess, run from the source tree `root`: (process, url or None)."""
    cmd = [sys.executable, "-m", "clover", "serve", "--port", "0", "--threads", str(args.threads),
           "--block-size", str(args.block_size), "--threshold", str(args.threshold),
           "--max-batch", str(max_batch), "--served-model-name", "bench", "--runner", runner]
    if args.model:
        cmd += ["--model", args.model]
    if getattr(args, "mode", None):
        cmd += ["--mode", args.mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=root)
    for line in proc.stdout:
        match = re.search(r"on (http://\S+)", line)
        if match:
            return proc, match.group(1)
    return proc, None


def structured_main(args) -> int:
    runner = args.runners
    if "," in runner:
        print("bench/serve.py: --structured takes one --runners value", file=sys.stderr)
        return 2
    cases = (("infill", PERSON), ("grammar", GRAMMAR))

    def work(url):
        if runner == "compiled":  # a pass to meet the shapes, compiled while idle, before the timed pass
            for _, schema in cases:
                asyncio.run(structured_case(url, "bench", schema, args.max_tokens))
            settle(url)
        return [(name, asyncio.run(structured_case(url, "bench", schema, args.max_tokens))) for name, schema in cases]

    rows = served(args, 32, work, runner)
    if rows is None:
        return 1
    model = args.model or "the shipped default model (clover/assets/default)"
    warm = " after a warm-up pass whose shapes it compiled while idle" if runner == "compiled" else ""
    print(f"`clover serve --runner {runner}` on {model}{warm}, {os.cpu_count()} CPU cores (server: {args.threads} torch thread), "
          f"block size {args.block_size}, threshold {args.threshold}: {len(ASKS)} structured-output requests "
          f"one after another, then the same {len(ASKS)} at once beside {len(PROMPTS)} free streams "
          f"({args.max_tokens} tokens each, greedy, ignore_eos).\n")
    print("| schema | method | sequential s | concurrent s | concurrent / sequential | replies = solo | "
          "free streams = solo | valid |")
    print("|---|---|---:|---:|---:|---|---|---:|")
    for name, r in rows:
        print(f"| {name} | {r['method']} | {r['seq']:.2f} | {r['conc']:.2f} | {r['ratio']:.2f} | "
              f"{'yes' if r['same'] else 'NO'} | {'yes' if r['free_same'] else 'NO'} | {r['valid']}/{len(ASKS)} |")
    infill = dict(rows)["infill"]
    print(f"\nInfilled requests: concurrent = {infill['ratio']:.2f}x sequential "
          f"(target < 0.5x: {'met' if infill['ratio'] < 0.5 else 'NOT met'}).")
    return 0


def metric(url: str, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def settle(url: str, timeout: float = 1800.0) -> float:
    """Wait until the server has compiled every shape it deferred (`clover_graphs_deferred` 0: a
    compiled server runs new shapes eagerly and compiles them when idle); the graphs it compiled so far."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout and metric(url, "clover_graphs_deferred") > 0:
        time.sleep(0.5)
    return metric(url, "clover_graphs_compiled_total")


async def all_at_once(url: str, max_tokens: int) -> list[str]:
    """Every prompt at once (one batch, rows of different prompt lengths), greedy: the replies."""
    import openai

    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    out = await asyncio.gather(*(free_stream(c, "bench", p, max_tokens) for p in PROMPTS))
    await c.close()
    return list(out)


def compare_runners(args, runners: list[str]) -> int:
    """One server per runner, up together; each level warmed once on each, then --rounds timed runs
    per runner, interleaved level by level (the machine's noise hits both alike); medians."""
    import statistics

    levels = [int(x) for x in args.clients.split(",")]
    servers = [start_server(args, max(levels), r) for r in runners]
    try:
        if any(url is None for _, url in servers):
            print("bench/serve.py: a server did not start", file=sys.stderr)
            return 1
        replies = [asyncio.run(all_at_once(url, args.max_tokens)) for _, url in servers]
        runs = {(r, n): [] for r in runners for n in levels}
        late = {r: 0.0 for r in runners}  # graphs of shapes first met in a timed round (run eagerly there)
        for n in levels:
            warm = {}
            for r, (_, url) in zip(runners, servers):  # warm-up: a compiled server meets this level's shapes
                asyncio.run(level(url, "bench", n, args.requests, args.max_tokens))
                warm[r] = settle(url)  # ... and compiles them once idle
            for _ in range(args.rounds):
                for r, (_, url) in zip(runners, servers):
                    runs[r, n].append(asyncio.run(level(url, "bench", n, args.requests, args.max_tokens)))
            for r, (_, url) in zip(runners, servers):
                late[r] += settle(url) - warm[r]
        compiled = {r: metric(url, "clover_graphs_compiled_total") for r, (_, url) in zip(runners, servers)}
        tpf = {r: metric(url, "clover_tokens_per_forward") for r, (_, url) in zip(runners, servers)}
    finally:
        for proc, _ in servers:
            stop_server(proc)
    med = {k: {f: statistics.median(run[f] for run in v) for f in ("tps", "p50", "p99", "ttfb", "wall")}
           for k, v in runs.items()}
    model = args.model or "the shipped default model (clover/assets/default)"
    print(f"`clover serve --runner R` on {model}, {os.cpu_count()} CPU cores (each server: {args.threads} torch "
          f"thread; {' and '.join(runners)} up together), {args.requests} streamed requests per client, "
          f"{args.max_tokens} tokens each (ignore_eos), block size {args.block_size}, threshold {args.threshold}, "
          f"greedy; each level warmed once per server, then medians of {args.rounds} rounds, runners interleaved.\n")
    print(f"| clients | runner | aggregate tokens/s | latency p50 s | latency p99 s | first block p50 s | vs {runners[0]} |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in levels:
        for r in runners:
            m = med[r, n]
            vs = f"{m['tps'] / med[runners[0], n]['tps']:.2f}x" if r != runners[0] else "1.00x"
            print(f"| {n} | {r} | {m['tps']:.1f} | {m['p50']:.2f} | {m['p99']:.2f} | {m['ttfb']:.2f} | {vs} |")
    for r in runners:
        if compiled[r]:
            print(f"\n{r}: {compiled[r]:.0f} graphs compiled while idle (warm-ups), {late[r]:.0f} of them for shapes "
                  "first met in a timed round (those steps ran eagerly there).")
    print("\nTokens per forward of a row (TPF, every finished row of the run): "
          + ", ".join(f"{r} {tpf[r]:.2f}" for r in runners) + ".")
    same = all(r == replies[0] for r in replies[1:])
    print(f"\nReplies to the {len(PROMPTS)} prompts sent at once (greedy, {args.max_tokens} tokens each): "
          f"{'equal' if same else 'NOT equal'} across runners.")
    return 0 if same else 1


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
    ap.add_argument("--structured", action="store_true",
                    help="structured-output requests: sequential vs concurrent beside free streams")
    ap.add_argument("--runners", default="eager", help="eager, compiled, or both (eager,compiled): side by side")
    ap.add_argument("--rounds", type=int, default=3, help="with several --runners: timed rounds per level (medians)")
    args = ap.parse_args()
    if args.structured:
        return structured_main(args)
    runners = args.runners.split(",")
    if len(runners) > 1:
        return compare_runners(args, runners)
    levels = [int(x) for x in args.clients.split(",")]
    rows = served(args, max(levels), lambda url: [asyncio.run(level(url, "bench", n, args.requests, args.max_tokens))
                                                  for n in levels])
    if rows is None:
        return 1

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
