"""A Clover server on a free loopback port, run by uvicorn in a thread of the test process, and the
clients the server tests talk to it with (the official `openai` client, raw HTTP, a metric's value)."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time

import openai
import uvicorn


class RunningServer:
    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def raw(server, method, path, body=None, headers=None, timeout=60):
    """One HTTP request: (status, headers, body text); `body` a dict (sent as JSON), str or bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, dict(resp.getheaders()), text


def metric(server, name) -> float:
    _, _, text = raw(server, "GET", "/metrics")
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
