"""Start-up of `clover serve` on a new user's machine, and its restart: how long until it answers,
its first replies against its steady ones, and (`--runner compiled`) when its graphs are in use.

    python bench/serve_start.py [--model DIR] [--rounds 5] [--requests 4] [--max-tokens 32] [--threads 1] [--restarts 3]

Each round starts an eager and a compiled server, one after the other, on empty caches: the
compile cache (`--compile-cache`) a fresh temporary folder; the C++ kernels' build folder
(TORCH_EXTENSIONS_DIR) fresh in round 1 (its start-up builds them), reused after. Each gets
--requests non-streamed completions once it answers /health (the same prompt, --max-tokens tokens,
ignore_eos): the eager server first, then the compiled one while its child compiles (not in turns:
the child runs while its own server is idle, i.e. during the other server's turn); the first reply
and the median of the others. The compiling child runs at niceness 0 here
(CLOVER_COMPILE_NICE, unless set: on a busy shared machine the default lowest priority starves it
and the bench would wait for its graphs for many minutes). In the last round
the bench then waits until the compiled server has every graph it deferred
(`clover_graphs_deferred` 0) and times --requests more on each (steady), then restarts the compiled
server --restarts times on the caches it filled: each restart's first replies against eager's taken
in the same turns (and, after the first restart, when its graphs are in use and its steady replies).
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


def launch(args, runner: str, extensions: Path, compile_cache: Path):
    """`clover serve` on these caches: (process, url, seconds from launch until /health answers)."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions))
    cmd = [sys.executable, "-m", "clover", "serve", "--port", "0", "--threads", str(args.threads),
           "--served-model-name", "bench", "--runner", runner]
    cmd += ["--compile-cache", str(compile_cache)] if runner == "compiled" else []
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


def stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=60)


def replies(servers: list[str], max_tokens: int, n: int) -> list[list[float]]:
    """n replies from each server, the servers taking turns (the same load for all)."""
    times = [[] for _ in servers]
    for _ in range(n):
        for i, url in enumerate(servers):
            times[i].append(reply_seconds(url, max_tokens))
    return times


def settle(url: str, t0: float) -> float:
    """Seconds from `t0` until the server has every graph it deferred."""
    while metric(url, "clover_graphs_deferred") > 0:
        time.sleep(0.2)
    return time.perf_counter() - t0


def one_round(args, tmp: Path, r: int, last: bool) -> dict:
    """An eager and a compiled server (empty compile cache; in round 0 empty kernel folders too): the
    eager server's replies first, alone, then the compiled server's while its child compiles (not in
    turns: a compiling child runs while its own server is idle, which would be the eager server's
    turn); in the last round also their steady replies and restarts of the compiled one."""
    out = {}
    eager, url_e, out["start_e"] = launch(args, "eager", tmp / "ext-eager", tmp / "unused")
    try:
        (out["first_e"],) = replies([url_e], args.max_tokens, args.requests)
        comp, url_c, out["start_c"] = launch(args, "compiled", tmp / "ext-compiled", tmp / f"compile-{r}")
        t0 = time.perf_counter() - out["start_c"]
        try:
            (out["first_c"],) = replies([url_c], args.max_tokens, args.requests)
            if last:
                out["ready_c"] = settle(url_c, t0)
                out["steady_e"], out["steady_c"] = replies([url_e, url_c], args.max_tokens, args.requests)
                out["graphs_c"] = metric(url_c, "clover_graphs_compiled_total")
        finally:
            stop(comp)
        if last:  # the restarts, on the caches this round's compiled server filled
            out["restarts"] = [restart(args, url_e, tmp / f"compile-{r}", i == 0) for i in range(args.restarts)]
    finally:
        stop(eager)
    return out


def restart(args, url_e: str, compile_cache: Path, steady: bool) -> dict:
    """The compiled server restarted on a filled compile cache: its first replies and eager's, in turn;
    with `steady`, when its graphs are in use and its replies then."""
    out = {}
    comp, url_w, out["start_w"] = launch(args, "compiled", compile_cache.parent / "ext-compiled", compile_cache)
    t0 = time.perf_counter() - out["start_w"]
    try:
        out["first_we"], out["first_w"] = replies([url_e, url_w], args.max_tokens, args.requests)
        if steady:
            out["ready_w"] = settle(url_w, t0)
            _, out["steady_w"] = replies([url_e, url_w], args.max_tokens, args.requests)
            out["graphs_w"] = metric(url_w, "clover_graphs_compiled_total")
    finally:
        stop(comp)
    return out


def med(rounds: list[dict], key: str, pick=lambda xs: xs[0]) -> float:
    return statistics.median(pick(r[key]) for r in rounds)


def print_table(args, rounds: list[dict]) -> None:
    last, nxt = rounds[-1], (lambda xs: statistics.median(xs[1:]))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, --threads {args.threads}, "
          f"{args.max_tokens}-token replies, {len(rounds)} rounds, load average {os.getloadavg()[0]:.2f} at the end, "
          f"compiling child at niceness {os.environ['CLOVER_COMPILE_NICE']}, share while decoding "
          f"{os.environ.get('CLOVER_COMPILE_SHARE', '0.2')}\n")
    print("| server | caches | start-up s (round 1 / later) | first reply s | next replies s | graphs in use "
          "at s | graphs | steady reply s |")
    print("|---|---|---|---|---|---|---|---|")
    later = rounds[1:] or rounds
    for name, k in (("eager", "e"), ("compiled", "c")):
        ready = f"{last['ready_c']:.1f}" if k == "c" else "-"
        graphs = int(last["graphs_c"]) if k == "c" else 0
        print(f"| {name} | empty | {rounds[0]['start_' + k]:.1f} / {med(later, 'start_' + k, float):.1f} | "
              f"{med(rounds, 'first_' + k):.2f} | {med(rounds, 'first_' + k, nxt):.2f} | {ready} | {graphs} | "
              f"{statistics.median(last['steady_' + k]):.2f} |")
    rs, w = last["restarts"], last["restarts"][0]
    print(f"| compiled | restart | {med(rs, 'start_w', float):.1f} | {med(rs, 'first_w'):.2f} | "
          f"{med(rs, 'first_w', nxt):.2f} | {w['ready_w']:.1f} | {int(w['graphs_w'])} | "
          f"{statistics.median(w['steady_w']):.2f} |")
    per_round = [r["first_c"][0] / r["first_e"][0] for r in rounds]
    print(f"\nMedians over the rounds (first reply: each server's first; next: the median of its others). "
          f"Eager first / eager steady: {med(rounds, 'first_e') / statistics.median(last['steady_e']):.2f} "
          f"(target <= 2). Compiled / eager, ratio of the medians: first reply "
          f"{med(rounds, 'first_c') / med(rounds, 'first_e'):.2f} (per round {min(per_round):.2f}-{max(per_round):.2f}), "
          f"next replies {med(rounds, 'first_c', nxt) / med(rounds, 'first_e', nxt):.2f} (target <= 1.2). "
          f"Restart ({len(rs)} restarts on the filled cache, medians): first reply / eager's in the same turns "
          f"{med(rs, 'first_w') / med(rs, 'first_we'):.2f}, next replies "
          f"{med(rs, 'first_w', nxt) / med(rs, 'first_we', nxt):.2f} (target <= 1.2); graphs in use "
          f"{w['ready_w']:.1f} s after launch against {last['ready_c']:.1f} s.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: the shipped default model)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--restarts", type=int, default=3, help="restarts of the compiled server on its filled cache")
    args = ap.parse_args()
    if args.requests < 2 or args.rounds < 1 or args.restarts < 1:
        raise SystemExit("bench/serve_start.py: --requests must be >= 2, --rounds and --restarts >= 1")
    os.environ.setdefault("CLOVER_COMPILE_NICE", "0")
    with tempfile.TemporaryDirectory(prefix="clover-start-") as tmp:
        rounds = [one_round(args, Path(tmp), r, r == args.rounds - 1) for r in range(args.rounds)]
    print_table(args, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
