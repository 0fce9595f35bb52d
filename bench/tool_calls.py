"""Forced tool calls through the one scheduler: 8 chat requests with tool_choice "required" and
parallel_tool_calls (each reply: one or more calls, the function picked by the model among --tools tools,
the arguments infilled) sent one after another, then the same 8 at once. Prints the wall time of
each (median of --rounds), the ratio concurrent / sequential (target <= 0.5: the requests' slot
jobs share batched forwards), whether the concurrent replies equal the sequential ones, the model
calls and tokens each way, and what one batched forward saves over one-row forwards of that size.

    PYTHONPATH=. python bench/tool_calls.py [--model DIR] [--rounds 3] [--threads 1] [--block-size 8]

The server runs in this process (uvicorn in a thread, a free loopback port); --model defaults to the
shipped default model.
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
    """Model calls, tokens fed (and of them padding) and seconds inside the model, from forward hooks."""

    def __init__(self, model):
        self.calls = self.fed = self.pad = 0
        self.seconds, self._t0 = 0.0, 0.0
        self.hooks = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                      model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs):
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, out):
        ids, pad = kwargs.get("input_ids", args[0] if args else None), kwargs.get("pad_mask")
        self.calls, self.fed = self.calls + 1, self.fed + ids.numel()
        self.pad += int(pad.sum()) if pad is not None else 0
        self.seconds += time.perf_counter() - self._t0

    def take(self) -> tuple:
        out = (self.calls, self.fed, self.pad, self.seconds)
        self.calls = self.fed = self.pad = 0
        self.seconds = 0.0
        return out


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


def rounds(one, n: int, meter: Meter, solo: list) -> tuple[list, list, bool]:
    """`n` rounds, each the 8 requests one after another then at once: [(wall s, meter)] of each, equal."""
    seq, par, equal = [], [], True
    with ThreadPoolExecutor(len(ASKS)) as pool:
        for _ in range(n):  # sequential and concurrent alternate
            meter.take()
            t0 = time.perf_counter()
            equal &= [one(a) for a in ASKS] == solo
            seq.append((time.perf_counter() - t0,) + meter.take())
            t0 = time.perf_counter()
            equal &= list(pool.map(one, ASKS)) == solo
            par.append((time.perf_counter() - t0,) + meter.take())
    return seq, par, equal


def report(args, solo, seq, par, equal, gain: dict, tokens: int) -> None:
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    s, p = med(seq, 0), med(par, 0)
    ratios = sorted(b[0] / a[0] for a, b in zip(seq, par))
    print(f"8 forced tool-call requests ({sum(len(c) for c in solo)} calls, {args.tools} tools; tool_choice required, "
          f"parallel_tool_calls; block {args.block_size}, {args.threads} torch thread(s), {os.cpu_count()} CPU cores, load "
          f"{os.getloadavg()[0]:.1f}; medians of {args.rounds} interleaved rounds):")
    print("\n| | sequential | concurrent |\n|---|---:|---:|")
    print(f"| wall s | {s:.2f} | {p:.2f} |")
    print(f"| model calls | {med(seq, 1):.0f} | {med(par, 1):.0f} |")
    print(f"| tokens fed (padding) | {med(seq, 2):.0f} ({med(seq, 3):.0f}) | {med(par, 2):.0f} ({med(par, 3):.0f}) |")
    print(f"| share of wall in the model | {med(seq, 4) / s:.0%} | {med(par, 4) / p:.0%} |")
    sizes = " / ".join(f"{gain[n]:.2f}x" for n in sorted(gain))
    print(f"\nconcurrent / sequential {p / s:.2f} (per round {', '.join(f'{r:.2f}' for r in ratios)}; target <= 0.5: "
          f"{'met' if p / s <= 0.5 else 'NOT met'}); replies equal: {'yes' if equal else 'NO'}. One forward of 8 rows "
          f"takes {sizes} the time of 8 one-row forwards at {' / '.join(map(str, sorted(gain)))} tokens a row "
          f"({tokens}: the mean a sequential call feeds).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tools", type=int, default=len(TOOLS), choices=range(1, len(TOOLS) + 1),
                    help="offer the first N tools (1: no function pick, the arguments only)")
    args = ap.parse_args()
    import torch

    import clover
    from clover.api import eos_ids
    from clover.server import Settings, create_app

    torch.set_num_threads(args.threads)
    model, tok = clover.load(args.model, device="cpu")
    app = create_app(model, tok, Settings(model_id="bench", block_size=args.block_size, max_batch=16),
                     eos_ids(model, tok))
    server, url = serve(app)
    one = lambda ask: call(url, ask, args.max_tokens, TOOLS[: args.tools])  # noqa: E731
    solo = [one(a) for a in ASKS]  # warm-up, and the replies to compare with
    meter = Meter(model)
    seq, par, equal = rounds(one, args.rounds, meter, solo)
    for h in meter.hooks:
        h.remove()
    server.should_exit = True
    tokens = round(statistics.median(r[2] / r[1] for r in seq))
    gain = {n: batching_gain(model, n) for n in sorted({16, 32, tokens})}
    report(args, solo, seq, par, equal, gain, tokens)


if __name__ == "__main__":
    main()
