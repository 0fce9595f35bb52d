"""Forced tool calls through the one scheduler: 8 chat requests with tool_choice "required" and
parallel_tool_calls (each reply: one or more calls, the function picked by the model among --tools tools,
the arguments infilled) sent one after another, then the same 8 at once. Prints the wall time of
each (median of --rounds), the ratio concurrent / sequential (target <= 0.5: the requests' slot
jobs share batched forwards) and whether the concurrent replies equal the sequential ones.

    PYTHONPATH=. python bench/tool_calls.py [--model DIR] [--rounds 3] [--threads 1] [--block-size 8]

The server runs in this process (uvicorn in a thread, a free loopback port); --model defaults to the
shipped default model.
"""

from __future__ import annotations

import argparse
import json
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
    seq, par, equal, forwards = [], [], True, []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    with ThreadPoolExecutor(len(ASKS)) as pool:
        for _ in range(args.rounds):  # sequential and concurrent alternate
            t0, f0 = time.perf_counter(), len(forwards)
            equal &= [one(a) for a in ASKS] == solo
            seq.append(time.perf_counter() - t0)
            t0, f1 = time.perf_counter(), len(forwards)
            equal &= list(pool.map(one, ASKS)) == solo
            par.append(time.perf_counter() - t0)
            calls = (f1 - f0, len(forwards) - f1)
    hook.remove()
    server.should_exit = True
    s, p = statistics.median(seq), statistics.median(par)
    n_calls = sum(len(c) for c in solo)
    print(f"8 forced tool-call requests ({n_calls} calls, {args.tools} tools; tool_choice required, parallel_tool_calls; block "
          f"{args.block_size}, {args.threads} thread(s), median of {args.rounds}):")
    print(f"| sequential s | concurrent s | concurrent / sequential | model calls seq / conc | replies equal |\n"
          f"|---|---|---|---|---|\n| {s:.2f} | {p:.2f} | {p / s:.2f} | {calls[0]} / {calls[1]} | {'yes' if equal else 'NO'} |")


if __name__ == "__main__":
    main()
