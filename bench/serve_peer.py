"""`clover serve` against stock llama.cpp's `llama-server`, side by side on one CPU, 1-32 clients.

    python bench/serve_peer.py [--sizes default,large] [--clients 1,4,16,32] [--requests 2]
                               [--max-tokens 64] [--rounds 3] [--threads N] [--default-threads 1] [--servers NAME,...]
                               [--large-rounds 1] [--large-requests 1] [--large-max-tokens N]
                               [--large-servers NAME,...] [--llama-server PATH] [--settle-timeout S] [--base TREE]
                               [--mode ar] [--block-size 8] [--threshold 0.9] [--trace FILE]
    python bench/serve_peer.py --dry-run      # the plan (models, servers, command lines); runs nothing
    python bench/serve_peer.py --smoke        # clover eager fp32 only, default dims, 1 and 2 clients, 8 tokens

The same random-weight model (seed 0) per size: `default` (the shipped model's dims, ~6M parameters)
and `large` (LARGE below, >= 100M parameters: weights beyond the CPU's caches). Clover serves its
folder (`--runner eager|compiled`, fp32, and an int4 RTN copy made by `clover quantize`, with int8
activations as q4_0 has unless --int4-activations float32, and its lm_head in int4 as the q4_0 GGUF's
output.weight is q4_0, unless --int4-head float);
llama-server serves its GGUF exports (`clover export-gguf`: f32, bf16, q8_0, q4_0), built by
`make llama-server`. Every server of a size is up at once, each with its best settings for this
machine: the same threads for both (--threads N at the large size, default every core; --default-threads
at the default size, default 1: there its ops take microseconds and a second thread's wait at the
end of every op costs more than it brings on a shared 2-core machine), llama-server with one slot per client of the
largest level (`--parallel`), continuous batching (`-cb`) and a context of that many slots; clover
batches up to that many rows (`--max-batch`).

Each client is a closed loop (the official async `openai` client, streaming, /v1/completions): a
held-out task prompt, exactly --max-tokens generated (`ignore_eos`, honoured by both servers),
greedy; clover streams at its default `--stream-interval-ms` (a row's tokens of up to 8 ms in one
chunk), llama-server a chunk per token. Per level, each server runs the requests of one round untimed (the same prompts, so a compiled
clover server meets every shape a round will), then --rounds timed rounds, servers interleaved within a
round. Before each timed run every compiled clover server has loaded the graphs of every shape it has
met (`clover_graphs_deferred` 0; its compiling child at normal priority, CLOVER_COMPILE_NICE=0), so no
compile runs beside a timed run, whichever server it times. The large
size has its own rounds, requests, reply length and servers (default: the matching pairs, clover
compiled). Tables: median aggregate tokens/s and its min - max over rounds, time to first token p50,
latency p50 / p99 (all requests of the median round), the ratio of medians against llama-server at
the matching precision (fp32 vs f32, int4 vs q4_0), what a clover round's forwards took (their
share of the wall, the mean forward, the eager ones of a compiled server: `/metrics`), each server's
CPU per generated token (its busiest thread, the decoding one, with how often per token it was
preempted, and all its threads: /proc, Linux) and the load average during the level. A missed point is listed with both servers' figures and that share.
--base TREE (a checkout of clover, e.g. a worktree of main) runs each clover server a second time
from that tree, as `NAME base`, interleaved with the others: a change measured before/after in one run.
--trace FILE appends every timed request as a JSON line (server, clients, the round's tokens/s, latency,
TTFT, client, request, start after the round's, longest wait between text chunks, start on the
machine's monotonic clock, which a server's own log can be lined up with): which requests are slow.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import metric, percentile, settle, start_server, stop_server  # noqa: E402  (bench/serve.py)

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SERVER = ROOT / "build" / "llamacpp" / "stock" / "bin" / "llama-server"
# the larger size: the default model's vocabulary and layer kinds, wider and deeper (167M parameters)
LARGE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
             linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, shared_expert_intermediate_size=1024,
             layer_types=None)
MATCH = {"fp32": "f32", "int4": "q4_0"}  # clover precision -> llama-server's matching GGUF type


@dataclass
class Server:
    """One server of the comparison: `kind` clover or llama-server, `precision` as the tables name it."""

    kind: str
    runner: str
    precision: str
    proc: subprocess.Popen | None = None
    url: str | None = None
    runs: dict = field(default_factory=dict)
    error: str | None = None  # why it stopped taking part (a failed request), if it did
    log: Path | None = None  # llama-server's output
    unready: str | None = None  # a compiled server whose graphs were not all loaded before its rounds
    ready_s: float = 0.0  # seconds waited for a compiled server's graphs
    base: str | None = None  # a clover server run from this source tree instead (--base): "... base"

    @property
    def name(self) -> str:
        if self.kind != "clover":
            return f"llama-server {self.precision}"
        return f"clover {self.runner} {self.precision}" + (" base" if self.base else "")


def all_servers() -> list[Server]:
    clover = [Server("clover", r, p) for p in ("fp32", "int4") for r in ("eager", "compiled")]
    return clover + [Server("llama-server", "-", t) for t in ("f32", "bf16", "q8_0", "q4_0")]


def pick_servers(names: str | None, have_llama: bool) -> list[Server]:
    """The servers named by --servers (comma-separated names as the tables print them, or `clover` /
    `llama-server` for all of a kind); llama-server ones only where the build exists."""
    servers = all_servers()
    if names:
        wanted = [n.strip() for n in names.split(",")]
        known = {s.name for s in servers} | {"clover", "llama-server"}
        bad = [n for n in wanted if n not in known]
        if bad:
            raise ValueError(f"unknown server {bad[0]!r} (known: {', '.join(sorted(known))})")
        servers = [s for s in servers if s.name in wanted or s.kind in wanted]
    if not have_llama:
        servers = [s for s in servers if s.kind == "clover"]
    return servers


def size_config(size: str):
    from clover.api import DEFAULT_MODEL
    from clover.models import CloverConfig

    config = CloverConfig.from_pretrained(DEFAULT_MODEL)
    if size == "large":
        config = CloverConfig(**{**config.to_dict(), **LARGE})
    return config


def make_folders(size: str, tmp: Path, precisions: set, int4_activations: str = "int8", int4_head: str = "int4") -> dict:
    """The size's random-weight model (seed 0) as an fp32 folder with the default tokenizer, and
    its int4 copy when asked (`clover quantize --activations int4_activations`, `--quantize-head` where `int4_head`
    is int4): {precision: folder}."""
    import torch

    from clover.api import DEFAULT_MODEL
    from clover.convert.quantize import quantize_checkpoint
    from clover.models import CloverForBlockDiffusion

    torch.manual_seed(0)
    folder = tmp / f"{size}-fp32"
    model = CloverForBlockDiffusion(size_config(size))
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    del model
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_MODEL / f, folder / f)
    folders = {"fp32": folder, "params": params}
    if "int4" in precisions:
        quantize_checkpoint(folder, tmp / f"{size}-int4", activations=int4_activations, quantize_head=int4_head == "int4",
                            notice=lambda msg: None)
        folders["int4"] = tmp / f"{size}-int4"
    return folders


def llama_command(gguf: Path, threads: int, slots: int, slot_ctx: int, binary: Path = LLAMA_SERVER) -> list[str]:
    """llama-server with its best settings here: every thread for decode and batch, one slot per
    client, continuous batching, a context of `slots` x `slot_ctx` tokens, loopback, any free port
    given later."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads),
            "--parallel", str(slots), "-cb", "-c", str(slots * slot_ctx), "--no-webui"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama(cmd: list[str], log: Path | None = None, timeout: float = 600.0):
    """llama-server in a subprocess, its output to `log` (a failure's report quotes its end): (process,
    url or None once /health answers 200)."""
    port = free_port()
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout and proc.poll() is None:
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    return proc, None


class Request(NamedTuple):
    """One timed request of a client (`client_loop`), as --trace writes it."""

    latency: float  # s
    ttft: float  # time to first token, s
    tokens: int
    client: int
    request: int  # the client's how-many-th
    start: float  # s after the level's start
    gap: float  # longest wait between text chunks, s
    chunks: int  # text chunks
    clock: float  # start on time.perf_counter's clock (the machine's monotonic one)


async def client_loop(c, prompts: list[str], cid: int, requests: int, max_tokens: int, out: list,
                      origin: float = 0.0) -> None:
    """One closed-loop client: a `Request` per request. Tokens are the server's `usage` count, else
    the streamed chunks that carried text."""
    for r in range(requests):
        t0 = last = time.perf_counter()
        first, tokens, chunks, gap = None, 0, 0, 0.0
        stream = await c.completions.create(model="bench", prompt=prompts[(cid + r) % len(prompts)], max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                now, chunks = time.perf_counter(), chunks + 1
                if first is None:
                    first = now - t0
                else:
                    gap = max(gap, now - last)
                last = now
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        out.append(Request(time.perf_counter() - t0, first or 0.0, tokens or chunks, cid, r, t0 - origin, gap, chunks, t0))


async def level(url: str, prompts: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    import openai

    # the client's default retries, for both servers alike: a connection llama-server drops when 32 clients
    # connect at once is retried (its wait counts in that request's latency), as a user's client would
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=2, timeout=1800)
    out: list = []
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    await asyncio.gather(*(client_loop(c, prompts, i, requests, max_tokens, out, t0) for i in range(clients)))
    wall = time.perf_counter() - t0
    await c.close()
    return summarise(out, wall, (load0 + os.getloadavg()[0]) / 2) | {"short": sum(o[2] != max_tokens for o in out),
                                                                     "requests": out}


def summarise(out: list, wall: float, load: float) -> dict:
    """A level's requests [(latency, ttft, tokens)] run in `wall` seconds: aggregate tokens/s, TTFT
    p50, latency p50 / p99."""
    lat, ttft, toks = list(zip(*out))[:3]
    return dict(tps=sum(toks) / wall, tokens=sum(toks), wall=wall, ttft=percentile(ttft, 0.5), p50=percentile(lat, 0.5),
                p99=percentile(lat, 0.99), load=load)


def median_run(runs: list[dict]) -> dict:
    """The round of median aggregate tokens/s (its latencies go to the table), with the spread of
    tokens/s over all rounds and their mean load average."""
    ordered = sorted(runs, key=lambda r: r["tps"])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid.update(tps=statistics.median(r["tps"] for r in runs), lo=ordered[0]["tps"], hi=ordered[-1]["tps"],
               load=statistics.mean(r["load"] for r in runs))
    return mid


def task_prompts(n: int) -> list[str]:
    from clover.data.tasks import plain_prompt
    from clover.eval import pareto

    return [plain_prompt(ex) for ex in pareto.examples(n)]


def slot_context(prompts: list[str], max_tokens: int) -> int:
    """Tokens one llama-server slot needs: the longest prompt and the reply, rounded up to 256."""
    from tokenizers import Tokenizer

    from clover.api import DEFAULT_MODEL

    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    longest = max(len(tok.encode(p).ids) for p in prompts)
    return -(-(longest + max_tokens + 16) // 256) * 256


def start(s: Server, args, files: dict, slots: int, slot_ctx: int, threads: int) -> None:
    """Start `s` on the size's files with `threads`; s.url stays None when it did not start."""
    from types import SimpleNamespace

    if s.kind == "clover":
        opts = SimpleNamespace(threads=threads, block_size=args.block_size, threshold=args.threshold,
                               mode=args.mode, model=str(files[s.precision]))
        s.proc, s.url = start_server(opts, slots, s.runner, root=s.base or ROOT)
    else:
        log = files["fp32"].parent / f"{s.name.replace(' ', '-')}.log"
        s.proc, s.url = start_llama(llama_command(files[s.precision], threads, slots, slot_ctx, args.llama_server), log)
        s.log = log
    if s.url is None:
        print(f"bench/serve_peer.py: {s.name} did not start", file=sys.stderr)


def run_size(size: str, servers: list[Server], args, tmp: Path, prompts: list[str]) -> dict:
    """Every server of one size up at once; per level a warm-up each (a compiled server then loads the
    graphs of the shapes it met: `ready`), then the size's rounds, servers interleaved. Returns the
    size's facts for the table; the servers' runs hold the rounds."""
    from clover.backends.gguf_export import export_gguf

    plan = size_plan(args, size)
    levels = [int(x) for x in args.clients.split(",")]
    files = make_folders(size, tmp, {s.precision for s in servers if s.kind == "clover"}, args.int4_activations,
                         args.int4_head)
    for t in {s.precision for s in servers if s.kind == "llama-server"}:
        files[t] = tmp / f"{size}-{t}.gguf"
        export_gguf(files["fp32"], files[t], t)
    slot_ctx = slot_context(prompts, plan.max_tokens)
    try:
        for s in servers:
            start(s, args, files, max(levels), slot_ctx, plan.threads)
        for n in levels:
            for s in servers:  # untimed, the requests of a round: a compiled server meets their shapes
                attempt(s, n, prompts, plan.requests, plan.max_tokens)
            for _ in range(plan.rounds):
                for s in servers:
                    quiet(servers, args.settle_timeout)  # no compiled server compiles beside a timed run
                    run = attempt(s, n, prompts, plan.requests, plan.max_tokens)
                    if run:
                        s.runs.setdefault(n, []).append(run)
                        trace(args.trace, s, n, run)
    finally:
        for s in servers:
            if s.proc is not None:
                stop_server(s.proc)
    return dict(params=files["params"], levels=levels, slot_ctx=slot_ctx, plan=plan)


def trace(path: Path | None, s: Server, n: int, run: dict) -> None:
    """A timed run's requests, one JSON line each, appended to `path` (--trace)."""
    if path is None:
        return
    import json

    with open(path, "a") as f:
        for o in run["requests"]:
            f.write(json.dumps({"server": s.name, "clients": n, "tps": run["tps"], **dict(zip(Request._fields, o))}) + "\n")


def size_plan(args, size: str):
    """Rounds, requests per client and tokens per reply of a size: the large one's own flags."""
    from types import SimpleNamespace

    if size == "large":
        return SimpleNamespace(rounds=args.large_rounds, requests=args.large_requests, threads=args.threads,
                               max_tokens=args.large_max_tokens or args.max_tokens)
    return SimpleNamespace(rounds=args.rounds, requests=args.requests, max_tokens=args.max_tokens,
                           threads=args.default_threads)


def quiet(servers: list[Server], timeout: float) -> None:
    """Before a timed run: every compiled clover server has loaded the graphs of the shapes it met
    (a shape first met in a timed round is compiled by the server's child, which would otherwise take
    a core from whichever server is timed next)."""
    for s in servers:
        if s.kind == "clover" and s.runner == "compiled" and s.error is None:
            ready(s, timeout)


def ready(s: Server, timeout: float) -> None:
    """Wait until a compiled server has loaded the graph of every shape it has met (its
    `clover_graphs_deferred` 0: the graphs are in use); one that does not within `timeout` s is
    noted (its timed rounds then run some steps eagerly, which the table counts)."""
    t0 = time.perf_counter()
    try:
        settle(s.url, timeout)
        left = metric(s.url, "clover_graphs_deferred")
    except OSError as e:  # the server went away: it leaves the comparison, the others go on
        s.error = f"waiting for its graphs: {type(e).__name__}: {e}"
        print(f"bench/serve_peer.py: {s.name} failed {s.error}", file=sys.stderr)
        return
    if left:
        s.unready = f"{left:.0f} shapes still without a graph after {timeout:.0f} s"
        print(f"bench/serve_peer.py: {s.name}: {s.unready}", file=sys.stderr)
    s.ready_s += time.perf_counter() - t0


def attempt(s: Server, n: int, prompts: list[str], requests: int, max_tokens: int) -> dict | None:
    """One level on a server that is up and has not failed; a failure is kept (s.error) and the
    server leaves the comparison, the others go on."""
    if s.url is None or s.error:
        return None
    try:
        before = counters(s.url) if s.kind == "clover" else None
        clock = thread_clock(s.proc.pid) if s.proc is not None else {}
        run = asyncio.run(level(s.url, prompts, n, requests, max_tokens))
        run["cpu"] = thread_costs(clock, thread_clock(s.proc.pid) if s.proc is not None else {}, run["tokens"])
        after = counters(s.url) if before else None
        if after:
            run["server"] = {k: after[k] - before[k] for k in after}
        return run
    except Exception as e:  # noqa: BLE001  (any client or server failure: reported in the table)
        s.error = f"{n} clients: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(f"bench/serve_peer.py: {s.name} failed at {s.error}", file=sys.stderr)
        if s.log is not None and s.log.exists():  # what the server said last
            print("".join(s.log.read_text(errors="replace").splitlines(True)[-20:]), file=sys.stderr)
        return None


def thread_clock(pid: int) -> dict:
    """{thread id: (CPU ns, involuntary context switches)} of a process's threads now (Linux /proc:
    schedstat, status); {} where there is none."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            cpu = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            out[tid] = (cpu, int(re.search(r"^nonvoluntary_ctxt_switches:\s*(\d+)", status, re.M).group(1)))
        except (OSError, ValueError, AttributeError, IndexError):  # a thread gone meanwhile, another kernel
            continue
    return out


def thread_costs(before: dict, after: dict, tokens: float) -> dict | None:
    """A round's server CPU per generated token (us): its busiest thread's (the decoding one) and all
    its threads', and how often per token the busiest thread was preempted (involuntary switches)."""
    deltas = [(cpu - before.get(t, (0, 0))[0], inv - before.get(t, (0, 0))[1]) for t, (cpu, inv) in after.items()]
    if not deltas or tokens <= 0:
        return None
    busiest = max(deltas)
    return dict(busiest_us=busiest[0] / tokens / 1e3, all_us=sum(d[0] for d in deltas) / tokens / 1e3,
                preempted=busiest[1] / tokens)


def cpu_text(run: dict) -> str:
    c = run.get("cpu")
    return "-" if not c else f"{c['busiest_us']:.0f} us ({c['preempted']:.1f}), {c['all_us']:.0f} us"


COUNTERS = ("clover_step_seconds_sum", "clover_model_forwards_total", "clover_graph_forwards_total",
            "clover_eager_forwards_total")


def counters(url: str) -> dict:
    """A clover server's decoding counters now (COUNTERS): seconds in forwards, forwards, and (compiled)
    forwards by a graph and eagerly."""
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    except OSError:  # the round itself then says what is wrong
        return {}
    return parse_counters(text)


def parse_counters(text: str) -> dict:
    values = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith(COUNTERS))
    return {k: float(values.get(k, 0)) for k in COUNTERS}


def forwards(run: dict, runner: str) -> str:
    """What a clover round's forwards took: their share of the round's wall time, the mean forward,
    and (compiled) how many ran eagerly."""
    c = run.get("server")
    if not c or not c["clover_model_forwards_total"]:
        return "-"
    n = c["clover_model_forwards_total"]
    text = f"{c['clover_step_seconds_sum'] / run['wall']:.0%}, {1e3 * c['clover_step_seconds_sum'] / n:.2f} ms"
    if runner == "compiled":
        text += f", {c['clover_eager_forwards_total']:.0f}/{c['clover_eager_forwards_total'] + c['clover_graph_forwards_total']:.0f} eager"
    return text


def peer(s: Server, servers: list[Server], n: int) -> Server | None:
    """llama-server at the precision matching a clover server's, when it ran the level of n clients."""
    want = MATCH.get(s.precision)
    return next((p for p in servers if p.kind == "llama-server" and p.precision == want and n in p.runs), None)


def print_size(size: str, facts: dict, servers: list[Server], args) -> list[str]:
    """The size's table; returns the must-show verdict lines (a missed point with what its clover
    server's forwards took, measured)."""
    plan = facts["plan"]
    print(f"\n**{size}** ({facts['params'] / 1e6:.1f}M parameters, random weights, seed 0): {plan.requests} "
          f"requests per client of {plan.max_tokens} tokens, medians of {plan.rounds} rounds\n")
    print("| clients | server | aggregate tokens/s | min - max | TTFT p50 s | latency p50 s | latency p99 s "
          "| vs llama-server, same precision (ratio of medians) | p99 / llama-server's "
          "| clover forwards: share of wall, mean, eager | server CPU per token: busiest thread (its preemptions "
          "per token), all threads | load avg |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    verdicts = []
    for n in facts["levels"]:
        for s in servers:
            if n in s.runs:
                verdicts += print_row(size, n, s, servers, plan)
    for s in servers:
        if s.error:
            print(f"\n{s.name}: failed at {s.error}.")
        elif s.url is None:
            print(f"\n{s.name}: did not start (no figures).")
        elif s.unready:
            print(f"\n{s.name}: {s.unready} (its eager forwards are counted in the table).")
    waited = {s.name: s.ready_s for s in servers if s.runner == "compiled" and s.url}
    if waited:
        print("\nWaited for the compiled servers' graphs (untimed): "
              + ", ".join(f"{k} {v:.0f} s" for k, v in waited.items()) + ".")
    return verdicts


def print_row(size: str, n: int, s: Server, servers: list[Server], plan) -> list[str]:
    """One server's row at n clients; its verdict line when it misses its llama-server peer."""
    m, p = median_run(s.runs[n]), peer(s, servers, n)
    ratio = p99 = "-"
    verdict = []
    fw = forwards(m, s.runner)
    if p is not None:
        pm = median_run(p.runs[n])
        ratio, p99 = f"{m['tps'] / pm['tps']:.2f}x", f"{m['p99'] / pm['p99']:.2f}x"
        if not (m["tps"] >= pm["tps"] and m["p99"] <= 1.5 * pm["p99"]):
            verdict.append(f"{size}, {n} clients, {s.name} vs {p.name}: tokens/s {m['tps']:.0f} vs {pm['tps']:.0f} "
                           f"({ratio}), p99 {m['p99']:.2f} s vs {pm['p99']:.2f} s ({p99}); clover's forwards: {fw}")
    short = sum(r.get("short", 0) for r in s.runs[n])  # replies not of the asked tokens: flagged
    name = s.name + (f" ({short} replies not {plan.max_tokens} tokens)" if short else "")
    print(f"| {n} | {name} | {m['tps']:.1f} | {m['lo']:.1f} - {m['hi']:.1f} | {m['ttft']:.3f} | "
          f"{m['p50']:.2f} | {m['p99']:.2f} | {ratio} | {p99} | {fw} | {cpu_text(m)} | {m['load']:.1f} |")
    return verdict


LARGE_SERVERS = "clover compiled fp32,clover compiled int4,llama-server f32,llama-server q4_0"


def dry_run(servers: dict, args) -> None:
    levels = args.clients
    for size, group in servers.items():
        plan = size_plan(args, size)
        print(f"{size}: clients {levels}; {plan.requests} requests per client, {plan.max_tokens} tokens each; "
              f"{plan.rounds} rounds; {plan.threads} threads; clover --mode {args.mode} --block-size {args.block_size} "
              f"--threshold {args.threshold}; servers: {', '.join(s.name for s in group)}")
    binary = args.llama_server
    print(f"llama-server: {binary} ({'built' if binary.exists() else 'NOT built: make llama-server'})")
    slots = max(int(x) for x in levels.split(","))
    for s in {s.name: s for group in servers.values() for s in group}.values():
        if s.kind == "clover":
            print(f"{s.name}: clover serve --runner {s.runner} --threads THREADS --max-batch {slots} "
                  f"--mode {args.mode} --model SIZE-{s.precision}/")
        else:
            print(f"{s.name}: " + " ".join(llama_command(Path(f"SIZE-{s.precision}.gguf"), "THREADS", slots, 512,
                                                         binary)) + " --port PORT  (-c: slots x the longest prompt and reply)")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="default,large", help="default, large or both")
    ap.add_argument("--clients", default="1,4,16,32")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per round")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (ignore_eos)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--large-requests", type=int, default=1, help="the large size's requests per client per round")
    ap.add_argument("--large-rounds", type=int, default=1, help="the large size's rounds")
    ap.add_argument("--large-max-tokens", type=int, help="the large size's tokens per reply (default: --max-tokens)")
    ap.add_argument("--large-servers", default=LARGE_SERVERS, help="the large size's servers (default: the pairs of "
                    "matching precision, clover compiled)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every server at the large size "
                    "(default: all cores)")
    ap.add_argument("--default-threads", type=int, default=1, help="threads of every server at the default size "
                    "(default 1: its ops take microseconds, and a second thread's wait at every op's end costs more "
                    "than it brings on a shared 2-core machine)")
    ap.add_argument("--servers", help="comma-separated server names (default: all; llama-server ones need its build)")
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER, help=f"the llama-server binary (default {LLAMA_SERVER})")
    ap.add_argument("--settle-timeout", type=float, default=900.0, help="longest wait (s) for a compiled server's "
                    "graphs after a level's warm-up")
    ap.add_argument("--mode", default="ar", help="clover's decoding mode (default ar: random weights commit about "
                    "one token per step in any mode)")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--int4-activations", choices=("int8", "float32"), default="int8", help="clover int4's activations "
                    "(`clover quantize --activations`; default int8, as q4_0 rounds its activations to q8_0)")
    ap.add_argument("--int4-head", choices=("int4", "float"), default="int4", help="clover int4's lm_head: int4 "
                    "(`clover quantize --quantize-head`; default, as the q4_0 GGUF's output.weight is q4_0) or kept float")
    ap.add_argument("--per-task", type=int, default=2, help="held-out task prompts per synthetic task")
    ap.add_argument("--base", type=Path, help="a clover source tree (a worktree of main): each clover server "
                    "also runs from it, as `NAME base`, interleaved (before/after a change in one run)")
    ap.add_argument("--trace", type=Path, help="append every timed request (latency, TTFT, client, start, longest "
                    "wait between chunks) to this file, one JSON line each")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--smoke", action="store_true", help="clover eager fp32 only, default size, 1 and 2 clients, "
                    "1 request of 8 tokens, 1 round: checks the script, measures nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sizes, args.clients, args.requests, args.max_tokens, args.rounds = "default", "1,2", 1, 8, 1
        args.servers = args.servers or "clover eager fp32"
    return ap, args


def main(argv=None) -> int:
    ap, args = parse(argv)
    have_llama = args.llama_server.exists() or args.dry_run
    try:
        sizes = args.sizes.split(",")
        if any(s not in ("default", "large") for s in sizes) or not all(int(x) > 0 for x in args.clients.split(",")):
            raise ValueError("--sizes takes default and/or large, --clients positive integers")
        servers = {size: pick_servers(args.large_servers if size == "large" else args.servers, have_llama)
                   for size in sizes}
        if args.base:  # each clover server also from the base tree, interleaved with it
            servers = {size: group + [Server(s.kind, s.runner, s.precision, base=str(args.base.resolve()))
                                      for s in group if s.kind == "clover"] for size, group in servers.items()}
    except ValueError as e:
        ap.exit(2, f"bench/serve_peer.py: {e}\n")
    if args.dry_run:
        dry_run(servers, args)
        return 0
    if not have_llama:
        print(f"bench/serve_peer.py: no {args.llama_server} (make llama-server): clover servers only", file=sys.stderr)
    os.environ.setdefault("CLOVER_COMPILE_NICE", "0")  # the compiling child not starved on a busy machine (untimed)
    prompts = task_prompts(args.per_task)
    print(header(args, prompts))
    verdicts = []
    for size in sizes:
        group = [Server(s.kind, s.runner, s.precision, base=s.base) for s in servers[size]]
        with tempfile.TemporaryDirectory() as d:
            facts = run_size(size, group, args, Path(d), prompts)
        verdicts += print_size(size, facts, group, args)
    if any(s.kind == "llama-server" for group in servers.values() for s in group):
        print("\nclover >= llama-server tokens/s with p99 <= 1.5x, every point: "
              + ("met." if not verdicts else "NOT met at:\n" + "\n".join(f"- {v}" for v in verdicts)))
    print(f"\nLoad average at the end: {os.getloadavg()[0]:.1f}.")
    return 0


def header(args, prompts: list[str]) -> str:
    large = (f" --large-requests {args.large_requests} --large-rounds {args.large_rounds}"
             + (f" --large-max-tokens {args.large_max_tokens}" if args.large_max_tokens else "")
             if "large" in args.sizes else "")
    return (f"`python bench/serve_peer.py --sizes {args.sizes} --clients {args.clients} --requests {args.requests} "
            f"--max-tokens {args.max_tokens} --rounds {args.rounds}{large} --threads {args.threads} --default-threads {args.default_threads} --mode {args.mode} "
            f"--int4-activations {args.int4_activations} --int4-head {args.int4_head}`: "
            f"{os.cpu_count()} CPU cores shared with other work, load average {os.getloadavg()[0]:.1f} at the start; "
            f"{len(prompts)} held-out task prompts (ignore_eos, greedy), streamed (clover at its default "
            "--stream-interval-ms: a row's tokens of up to 8 ms in one chunk, its first and last at once; llama-server "
            "a chunk per token); servers interleaved; a compiled "
            "server's graphs loaded (untimed) before each timed run. Clover forwards: the scheduler's time in "
            "forwards over the round's wall time, the mean forward, and forwards run eagerly (compiled servers). "
            "Server CPU per token: CPU time per generated token of the server's busiest thread (involuntary "
            "context switches per token in brackets) and of all its threads (/proc).")


if __name__ == "__main__":
    sys.exit(main())
