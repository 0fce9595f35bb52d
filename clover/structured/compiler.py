"""Grammar compilation within a time budget.

xgrammar compiles a JSON schema's grammar in C++ that cannot be interrupted, and some real-world
schemas (a Swagger 2.0 document with its maps and arrays at the grammar path's caps) take minutes.
A grammar small enough to be cheap (`IN_PROCESS_CHARS` of schema JSON) is compiled here; a larger one
in a worker process (this file run by itself, started on first use and kept), which is
killed when the compile passes its deadline: `CompileTimeout` then, and the worker is started again
for the next one. The worker sends the compiled grammar back serialised (xgrammar's own format).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time

IN_PROCESS_CHARS = 4000  # schema JSON up to this size is compiled in this process (milliseconds)
START_SECONDS = 120.0  # how long the worker may take to start (importing xgrammar)


class CompileTimeout(Exception):
    """The compile did not finish within its deadline (the worker was stopped)."""


class CompileError(Exception):
    """xgrammar refused the schema (its message, first line)."""


def compile_options() -> dict:
    return {"any_whitespace": False, "strict_mode": True}


def _send(stream, payload: bytes) -> None:
    stream.write(struct.pack("<Q", len(payload)) + payload)
    stream.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise CompileTimeout()
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError("the grammar worker exited")
        out += chunk
    return bytes(out)


def _receive(fd: int, deadline: float | None) -> bytes:
    (n,) = struct.unpack("<Q", _read_exact(fd, 8, deadline))
    return _read_exact(fd, n, deadline)


class _Worker:
    """One worker process and the tokenizers it has been sent (by key)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-I", __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.known: set = set()
        _receive(self.proc.stdout.fileno(), time.monotonic() + START_SECONDS)  # ready

    def compile(self, key, info_json: str, schema_json: str, seconds: float) -> str:
        message = {"key": str(key), "schema": schema_json}
        if key not in self.known:
            message["info"] = info_json
        _send(self.proc.stdin, json.dumps(message).encode())
        self.known.add(key)
        reply = json.loads(_receive(self.proc.stdout.fileno(), time.monotonic() + seconds))
        if "error" in reply:
            raise CompileError(reply["error"])
        return reply["grammar"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_LOCK = threading.Lock()
_WORKER: list[_Worker] = []


def compile_in_worker(key, tokenizer_info, schema_json: str, seconds: float):
    """The compiled grammar of `schema_json` for `tokenizer_info` (cached in the worker under `key`),
    compiled in the worker process within `seconds`; CompileTimeout past them, CompileError for
    xgrammar's refusal. One compile at a time (the others wait for the worker, outside their budget)."""
    import xgrammar as xgr

    with _LOCK:
        if not _WORKER or _WORKER[0].proc.poll() is not None:
            _WORKER[:] = [_Worker()]
        worker = _WORKER[0]
        try:
            data = worker.compile(key, tokenizer_info.serialize_json(), schema_json, seconds)
        except (CompileTimeout, EOFError, OSError) as e:
            worker.stop()
            _WORKER.clear()
            if isinstance(e, CompileTimeout):
                raise
            raise CompileError(f"the grammar worker failed ({type(e).__name__})") from None
    return xgr.CompiledGrammar.deserialize_json(data, tokenizer_info)


@atexit.register
def _stop_worker() -> None:
    for w in _WORKER:
        w.stop()


def _serve() -> None:
    """The worker: compile each request, reply with the serialised grammar or the error's first line."""
    import xgrammar as xgr

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    compilers: dict[str, object] = {}
    _send(stdout, b"ready")
    while True:
        try:
            message = json.loads(_receive(stdin.fileno(), None))
        except EOFError:
            return
        try:
            if message["key"] not in compilers:
                info = xgr.TokenizerInfo.deserialize_json(message["info"])
                compilers[message["key"]] = xgr.GrammarCompiler(info, max_threads=1)
            grammar = compilers[message["key"]].compile_json_schema(message["schema"], **compile_options())
            reply = {"grammar": grammar.serialize_json()}
        except Exception as e:  # xgrammar's RuntimeError / ValueError: the reason goes back
            reply = {"error": (str(e).splitlines() or [type(e).__name__])[0]}
        _send(stdout, json.dumps(reply).encode())


if __name__ == "__main__":
    _serve()
