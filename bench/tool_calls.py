"""Forced tool calls through the one scheduler: 8 chat requests with tool_choice "required" and
parallel_tool_calls (each reply: one or more calls, the function picked by the model among --tools tools,
the arguments infilled) sent one after another, then the same 8 at once. Prints the wall time of
each (median of --rounds), the ratio concurrent / sequential (target <= 0.5: the requests' slot
jobs share batched forwards), whether the concurrent replies equal the sequential ones, the model
calls and tokens each way, and what one batched forward saves over one-row forwards of that size; then why:
a model call's cost (per call, per token fed), the ratio the fewest forwards would reach with the same tokens,
and with the tokens an exact prefix cache would save (estimated from the jobs' first forwards, nothing cached).

    PYTHONPATH=. python bench/tool_calls.py [--model DIR | --size large] [--rounds 3] [--threads 1,2] [--block-size 8]

The server runs in this process (uvicorn in a thread, a free loopback port); --model defaults to the
shipped default model. `--size large` serves instead bench/serve_peer.py's large random-weight model
(seed 0, the default model's vocabulary and tokenizer, >= 100M parameters: weights beyond the CPU's
caches, where one forward of many rows should cost less than the rows' one-row forwards).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ASKS = ["What is the weather in Paris?", "Add 3 and 4.", "Weather in Rome and Oslo, please.", "Convert 12 km to miles.",
        "Is it raining in Berlin?", "What is 17 plus 25?", "How far is 5 miles in km?", "Weather at home: Madrid."]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}},
         {"type": "function", "function": {"name": "convert", "parameters": {
             "type": "object", "properties": {"value": {"type": "number"}, "unit": {"enum": ["km", "miles"]}},
             "required": ["value", "unit"]}}}]


def serve(app):
    """uvicorn on a free loopback port in a daemon thread: (server, base url)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def call(url: str, ask: str, max_tokens: int, tools: list[dict]) -> list[dict]:
    import http.client

    body = {"model": "bench", "messages": [{"role": "user", "content": ask}], "tools": tools,
            "tool_choice": "required", "parallel_tool_calls": True, "max_tokens": max_tokens}
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host.split("//")[1], int(port), timeout=600)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    reply = json.loads(conn.getresponse().read())
    conn.close()
    return [c["function"] for c in reply["choices"][0]["message"]["tool_calls"]]


class Meter:
    """Every model call (rows, tokens fed, of them padding, draft-window tokens, seconds, and for a job's first
    forward of one row its window width and clean context), from forward hooks."""

    def __init__(self, model):
        self.records: list[tuple] = []
        self._t0, self._fresh = 0.0, False
        self.hooks = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                      model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs):
        cache = kwargs.get("cache")
        self._fresh = cache is not None and int(cache.lens.max()) == 0
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, out):
        seconds = time.perf_counter() - self._t0
        ids, pad = kwargs.get("input_ids", args[0] if args else None), kwargs.get("pad_mask")
        rows, draft, first = ids.shape[0], kwargs.get("draft_len") or 0, None
        if self._fresh and rows == 1:
            first = (kwargs.get("clean_block_size"), tuple(ids[0, : ids.shape[1] - draft].tolist()))
        self.records.append((rows, ids.numel(), int(pad.sum()) if pad is not None else 0, rows * draft, seconds, first))

    def take(self) -> list[tuple]:
        out, self.records = self.records, []
        return out


def totals(records: list[tuple]) -> tuple:
    """(model calls, tokens fed, padding, seconds in the model) of a pass."""
    return (len(records), sum(r[1] for r in records), sum(r[2] for r in records), sum(r[4] for r in records))


def cache_savings(firsts: list[tuple]) -> tuple[int, int]:
    """Tokens an exact prefix cache would save the jobs' first forwards, [(window width W, clean context)] in
    order: a context is laid out in clean windows of W anchored at its end, so a snapshot after P tokens
    serves only a job of the same W whose boundaries fall on P. (Within a pass, every boundary of every
    context before stored; the prefix all contexts share stored at every alignment.)"""
    seen, within, ref = set(), 0, firsts[0][1]
    shared = min(next((i for i, (x, y) in enumerate(zip(c, ref)) if x != y), min(len(c), len(ref)))
                 for _, c in firsts)
    for w, c in firsts:
        bounds = range(len(c) % w or w, len(c) + 1, w)
        within += max([p for p in bounds if (w, c[:p]) in seen] + [0])
        seen |= {(w, c[:p]) for p in bounds}
    return within, sum(max([p for p in range(len(c) % w or w, shared + 1, w)] + [0]) for w, c in firsts)


def step_savings(reqs: list[list[tuple]]) -> int:
    """Tokens the jobs of a sequential pass (each request's records) would not feed if run concurrently in
    step (the k-th job of every request beside each other) with every prefix shared that exact layouts allow:
    rows of one window width and phase (length modulo it) share up to a window boundary of each
    (`slots.prefix_groups`, as `slots.share_prefixes` does, whatever it pays)."""
    from clover.engine.slots import prefix_groups

    jobs = [[r[5] for r in req if r[5] is not None] for req in reqs]
    saved = 0
    for k in range(max(map(len, jobs))):
        firsts = [j[k] for j in jobs if len(j) > k]
        for w in {w for w, _ in firsts}:
            rows = [list(c) for v, c in firsts if v == w]
            saved += sum((len(members) - 1) * b for members, b in prefix_groups(rows, w))
    return saved


def call_cost(model, window: int = 9, repeats: int = 7) -> tuple[float, float]:
    """(seconds per model call, per token fed): least squares over the medians of one-row calls of a job's
    first forward (a fresh cache, a clean context of 0 to 256 tokens and a draft window), sizes interleaved."""
    import torch

    from clover.engine.runner import make_runner

    runner, sizes = make_runner("eager", model), [0, 32, 64, 128, 256]
    times: dict[int, list[float]] = {n: [] for n in sizes}
    ids = torch.randint(0, model.config.vocab_size, (1, sizes[-1] + window))
    with torch.inference_mode():
        for _ in range(repeats):
            for n in sizes:
                t0 = time.perf_counter()
                runner.forward(ids[:, : n + window], runner.new_cache(1, capacity=n + window), block_size=window,
                               draft_len=window, clean_block_size=window, logits_to_keep=window)
                times[n].append(time.perf_counter() - t0)
    xs, ys = [n + window for n in sizes], [statistics.median(times[n]) for n in sizes]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def batching_gain(model, tokens: int, rows: int = 8, repeats: int = 5) -> float:
    """Median time of one forward of `rows` rows x `tokens` tokens over that of `rows` one-row forwards
    (fresh caches, the clean path every job's first forward takes): what batching alone can save."""
    import torch

    from clover.engine.runner import make_runner

    runner, ratios = make_runner("eager", model), []
    ids = torch.randint(0, model.config.vocab_size, (rows, tokens))
    for _ in range(repeats):
        with torch.inference_mode():
            t0 = time.perf_counter()
            for r in range(rows):
                runner.forward(ids[r: r + 1], runner.new_cache(1, capacity=tokens), clean_block_size=8, logits_to_keep=8)
            t1 = time.perf_counter()
            runner.forward(ids, runner.new_cache(rows, capacity=tokens), clean_block_size=8, logits_to_keep=8)
            ratios.append((time.perf_counter() - t1) / (t1 - t0))
    return statistics.median(ratios)


def rounds(one, n: int, meter: Meter, solo: list) -> tuple[list, list, bool, list, int]:
    """`n` rounds, each the 8 requests one after another then at once: [(wall s, calls, fed, pad, model s)]
    of each, whether every reply equals `solo`, each sequential pass's model calls (by request) and the most calls one
    request took (the longest chain of forwards a request needs, whatever runs beside it)."""
    seq, par, equal, calls, chain = [], [], True, [], 0
    with ThreadPoolExecutor(len(ASKS)) as pool:
        for _ in range(n):  # sequential and concurrent alternate
            meter.take()
            t0, records, replies = time.perf_counter(), [], []
            for a in ASKS:
                replies.append(one(a))
                records.append(meter.take())
            seq.append((time.perf_counter() - t0,) + totals([r for req in records for r in req]))
            equal &= replies == solo
            calls.append(records)
            chain = max([chain] + [len(req) for req in records])
            t0 = time.perf_counter()
            equal &= list(pool.map(one, ASKS)) == solo
            par.append((time.perf_counter() - t0,) + totals(meter.take()))
    return seq, par, equal, calls, chain


def floors(cost: tuple[float, float], passes: list[list[list[tuple]]], chain: int, taken: float) -> str:
    """What the cost of a model call (`call_cost`: a + b x tokens) lets the ratio reach, concurrent model time
    over sequential, both ways feeding the same tokens: as the sequential pass feeds (no job shares another's work), less
    what an exact prefix cache would save (`cache_savings`, both ways alike), each request's prompt fed
    once and then only its draft windows (no job re-feeding its request's context), or only the draft
    windows (every context cached: an exact replay); in the fewest forwards concurrency could take (the
    longest request's chain) and in the forwards it took."""
    a, b = cost
    mean = lambda f: statistics.mean(f([r for req in reqs for r in req]) for reqs in passes)  # noqa: E731
    n, fed, drafts = mean(len), mean(lambda c: sum(r[1] for r in c)), mean(lambda c: sum(r[3] for r in c))
    saved = [cache_savings([r[5] for req in reqs for r in req if r[5] is not None]) for reqs in passes]
    once = statistics.mean(sum(len(req[0][5][1]) for req in reqs if req and req[0][5]) for reqs in passes) + drafts
    within, shared = statistics.mean(t[0] for t in saved), statistics.mean(t[1] for t in saved)
    cases = [("as the sequential pass feeds: no job shares another's work", fed),
             ("an exact prefix cache, from empty each pass", fed - within),
             ("the same, the shared system prompt cached at every alignment", fed - shared),
             ("each request's prompt fed once, then its draft windows", once),
             ("every context cached (an exact replay): the draft windows only", drafts)]
    lines = [f"\nWhy: a model call costs {a * 1e3:.1f} ms + {b * 1e3:.3f} ms a token fed (one-row calls of a job's first "
             f"forward, 9 to 265 tokens), so concurrent / sequential model time would be, feeding (both ways; optimistic for "
             f"concurrency: a batched call costs more than that for its tokens, as the batching gains above show):\n",
             f"| tokens fed | per pass | in {chain} forwards (the longest request's chain) | in {taken:.0f} (taken) |",
             "|---|---:|---:|---:|"]
    for what, tokens in cases:
        lines.append(f"| {what} | {tokens:.0f} | {(chain * a + tokens * b) / (n * a + tokens * b):.2f}x | "
                     f"{(taken * a + tokens * b) / (n * a + tokens * b):.2f}x |")
    step = statistics.mean(step_savings(reqs) for reqs in passes)
    lines.append(f"\nConcurrency alone (the sequential pass feeding all {fed:.0f}) saves at most the work jobs in step share: "
                 f"{step:.0f} tokens in prefixes of one window width and phase, so at best "
                 f"{(chain * a + (fed - step) * b) / (n * a + fed * b):.2f}x in {chain} forwards, "
                 f"{(taken * a + (fed - step) * b) / (n * a + fed * b):.2f}x in {taken:.0f}.")
    lines.append("\nA request lays its context out once (engine/infill.Context), causally (clean windows of one token) when "
                 "several jobs may run: its later jobs start from that cache and feed only what their prompts add, and "
                 "concurrent requests' first jobs commit their common beginning once (slots.share_prefixes); the scaffold "
                 "before a job's first slot rides with its prompt (infill.Row.lead_in), so the 'another call?' job re-feeds "
                 "only the arguments, and a causal context also keeps where a job ended (infill.Context.close), so the job "
                 "after arguments of several windows feeds only the last one; a burst's tasks wait for the requests still "
                 "on their way (Scheduler.arriving) and start in one forward, and a later job with no partner runs at once "
                 "rather than putting its request a step behind the others (slots.ready); jobs of different window "
                 "widths share forwards too, the narrower windows right-padded and masked (slots.SlotJob.ragged). The "
                 "prefix-cache rows above count the first jobs' contexts only.")
    return "\n".join(lines)


def report(args, solo, seq, par, equal, gain: dict, tokens: int) -> tuple[str, str]:
    """(the run's table and findings, its ratio in one line for the summary above all runs)."""
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    s, p = med(seq, 0), med(par, 0)
    ratios = sorted(b[0] / a[0] for a, b in zip(seq, par))
    sizes = " / ".join(f"{gain[n]:.2f}x" for n in sorted(gain))
    text = "\n".join([
        f"8 forced tool-call requests to {args.name} ({sum(len(c) for c in solo)} calls, {args.tools} tools; "
        f"tool_choice required, "
        f"parallel_tool_calls; block {args.block_size}, {args.threads} torch thread(s), {os.cpu_count()} CPU cores, load "
        f"{os.getloadavg()[0]:.1f}; medians of {args.rounds} interleaved rounds):",
        "\n| | sequential | concurrent |\n|---|---:|---:|",
        f"| wall s | {s:.2f} | {p:.2f} |",
        f"| model calls | {med(seq, 1):.0f} | {med(par, 1):.0f} |",
        f"| tokens fed (padding) | {med(seq, 2):.0f} ({med(seq, 3):.0f}) | {med(par, 2):.0f} ({med(par, 3):.0f}) |",
        f"| share of wall in the model | {med(seq, 4) / s:.0%} | {med(par, 4) / p:.0%} |",
        f"\nconcurrent / sequential {p / s:.2f} (per round {', '.join(f'{r:.2f}' for r in ratios)}; target <= 0.5: "
        f"{'met' if p / s <= 0.5 else 'NOT met'}); replies equal: {'yes' if equal else 'NO'}. One forward of 8 rows "
        f"takes {sizes} the time of 8 one-row forwards at {' / '.join(map(str, sorted(gain)))} tokens a row "
        f"({tokens}: the mean a sequential call feeds).\n"])
    return text, f"{args.threads} thread(s) {p / s:.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]"


def load_model(args, tmp: str):
    """(model, tokenizer, its name for the report): --model's folder, the default model, or (--size large)
    bench/serve_peer.py's large random-weight model written to `tmp`."""
    import clover

    if args.size == "large":
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from serve_peer import make_folders  # bench/serve_peer.py

        folder = make_folders("large", Path(tmp), {"fp32"})["fp32"]
        return (*clover.load(folder, device="cpu"), "serve_peer's large random-weight model")
    return (*clover.load(args.model, device="cpu"), args.model or "the default model")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a model folder (default: the shipped default model)")
    ap.add_argument("--size", choices=("default", "large"), default="default",
                    help="large: bench/serve_peer.py's large random-weight model instead (not with --model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2",
                    help="torch threads, a comma list run one after another (2: the server's default on 2 cores)")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tools", type=int, default=len(TOOLS), choices=range(1, len(TOOLS) + 1),
                    help="offer the first N tools (1: no function pick, the arguments only)")
    args = ap.parse_args()
    try:
        args.thread_list = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads: a comma list of integers, got {args.threads!r}")
    if args.model and args.size != "default":
        ap.error("--model and --size large name two models: give one")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run(args, tmp)


def run(args, tmp: str) -> None:
    import torch

    from clover.api import eos_ids
    from clover.server import Settings, create_app

    model, tok, name = load_model(args, tmp)
    args.name = f"{name}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters"
    app = create_app(model, tok, Settings(model_id="bench", block_size=args.block_size, max_batch=16),
                     eos_ids(model, tok))
    server, url = serve(app)
    one = lambda ask: call(url, ask, args.max_tokens, TOOLS[: args.tools])  # noqa: E731
    outs, summary = [], []
    for threads in args.thread_list:
        args.threads = threads
        torch.set_num_threads(threads)
        solo = [one(a) for a in ASKS]  # warm-up, and the replies to compare with
        meter = Meter(model)
        seq, par, equal, calls, chain = rounds(one, args.rounds, meter, solo)
        for h in meter.hooks:
            h.remove()
        tokens = round(statistics.median(r[2] / r[1] for r in seq))
        gain = {n: batching_gain(model, n) for n in sorted({16, 32, tokens})}
        text, line = report(args, solo, seq, par, equal, gain, tokens)
        outs.append(text)
        summary.append(line)
    print("concurrent / sequential wall, ratio of medians [range of per-round ratios]: " + "; ".join(summary)
          + " (target <= 0.5; torch's default, one thread per core, is what `clover serve` uses)\n")
    print("\n".join(outs), end="")
    print(floors(call_cost(model), calls, chain, statistics.median(r[1] for r in par)))
    server.should_exit = True


if __name__ == "__main__":
    main()
