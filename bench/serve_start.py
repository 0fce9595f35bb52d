"""Start-up of `clover serve` on a new user's machine, and its restart: how long until it answers,
its first replies against its steady ones, and (`--runner compiled`) when its graphs are in use.

    python bench/serve_start.py [--model DIR] [--requests 6] [--max-tokens 32] [--threads 1]

Three servers, one after another: eager and compiled on empty caches (the C++ kernels' build folder,
TORCH_EXTENSIONS_DIR, and the compile cache, `--compile-cache`, each a fresh temporary folder), then
the compiled one restarted on the caches its first run filled. Each gets --requests non-streamed
completions one after another from the moment it answers /health (the same prompt, --max-tokens
tokens, ignore_eos): the first reply and the median of the others; then the bench waits until the
server has every graph it deferred (`clover_graphs_deferred` 0) and times --requests more (steady).
Prints one markdown table and the ratios the issue asks for: eager first / eager steady (target
<= 2), compiled first replies / eager's (target <= 1.2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Shall I compare thee to a summer's day?"


def get(url: str, timeout: float = 5.0) -> str:
    return urllib.request.urlopen(url, timeout=timeout).read().decode()


def metric(url: str, name: str) -> float:
    for line in get(url + "/metrics", 30).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def reply_seconds(url: str, max_tokens: int) -> float:
    body = json.dumps({"model": "bench", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    json.loads(urllib.request.urlopen(request, timeout=1800).read())
    return time.perf_counter() - t0


def launch(args, runner: str, caches: Path):
    """`clover serve` on the caches in `caches`: (process, url, seconds from launch until /health answers)."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(caches / "extensions"))
    cmd = [sys.executable, "-m", "clover", "serve", "--port", "0", "--threads", str(args.threads),
           "--served-model-name", "bench", "--runner", runner]
    cmd += ["--compile-cache", str(caches / "compile")] if runner == "compiled" else []
    cmd += ["--model", args.model] if args.model else []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    url = next((line.split(" on ")[1].split()[0] for line in proc.stdout if " on http://" in line), None)
    while url is not None and proc.poll() is None:
        try:
            get(url + "/health")
            return proc, url, time.perf_counter() - t0
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"bench/serve_start.py: the {runner} server did not start")


def run_server(args, runner: str, caches: Path) -> dict:
    proc, url, started = launch(args, runner, caches)
    t0 = time.perf_counter() - started  # the launch
    try:
        first = [reply_seconds(url, args.max_tokens) for _ in range(args.requests)]
        while metric(url, "clover_graphs_deferred") > 0:
            time.sleep(0.2)
        ready = time.perf_counter() - t0
        steady = [reply_seconds(url, args.max_tokens) for _ in range(args.requests)]
        graphs = metric(url, "clover_graphs_compiled_total")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"start": started, "first": first[0], "next": statistics.median(first[1:]), "ready": ready,
            "steady": statistics.median(steady), "graphs": int(graphs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: the shipped default model)")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.requests < 2:
        raise SystemExit("bench/serve_start.py: --requests must be >= 2")
    with tempfile.TemporaryDirectory(prefix="clover-start-") as tmp:
        rows = [("eager", "empty", run_server(args, "eager", Path(tmp) / "eager")),
                ("compiled", "empty", run_server(args, "compiled", Path(tmp) / "compiled")),
                ("compiled", "restart", run_server(args, "compiled", Path(tmp) / "compiled"))]
    load = os.getloadavg()[0]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, --threads {args.threads}, "
          f"{args.max_tokens}-token replies, load average {load:.2f} at the end\n")
    print("| server | caches | start-up s | first reply s | next replies s (median) | graphs in use at s | "
          "graphs | steady reply s |")
    print("|---|---|---|---|---|---|---|---|")
    for runner, caches, r in rows:
        print(f"| {runner} | {caches} | {r['start']:.1f} | {r['first']:.2f} | {r['next']:.2f} | {r['ready']:.1f} | "
              f"{r['graphs']} | {r['steady']:.2f} |")
    eager, cold, warm = (r for _, _, r in rows)
    print(f"\neager first / eager steady: {eager['first'] / eager['steady']:.2f} (target <= 2); compiled first "
          f"replies / eager's (empty caches): first {cold['first'] / eager['first']:.2f}, next "
          f"{cold['next'] / eager['next']:.2f} (target <= 1.2); restart: first {warm['first'] / eager['first']:.2f}, "
          f"graphs in use {warm['ready']:.1f} s after launch against {cold['ready']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
