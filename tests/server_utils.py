"""A Clover server on a free loopback port, run by uvicorn in a thread of the test process, and the
clients the server tests talk to it with (the official `openai` client, raw HTTP, a metric's value)."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time

import openai
import uvicorn

from clover.cli.serve import bind


class RunningServer:
    def __init__(self, app):
        self.sock = bind("127.0.0.1", 0)  # `clover serve`'s own listening socket (TCP_NODELAY on its connections)
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


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TOOL_ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tools_model(folder, seed: int = 0):
    """(model, tokenizer): a tiny random model (seed `seed`, head scaled: several tokens per step) on a
    Clover BPE tokenizer trained on a few tool-call dialogues (atomic <tool_call> tokens, the chat
    template that renders tools), saved in `folder` and loaded as `clover serve` loads it."""
    import torch
    from transformers import AutoTokenizer

    import clover
    from clover.chat import IM_END, render_chat
    from clover.data.tokenizer import EOS, MASK, build_bpe, save_tokenizer
    from clover.models import CloverForBlockDiffusion, preset_config

    corpus = [render_chat(TOOL_ASK + [{"role": "assistant", "content": TOOL_CALL}], tools=[WEATHER])] * 8
    save_tokenizer(build_bpe(corpus, 300), folder, model_max_length=1024)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.convert_tokens_to_ids
    config = preset_config("clover-tiny", vocab_size=len(tokenizer), mask_token_id=ids(MASK),
                           eos_token_id=[ids(EOS), ids(IM_END)])
    torch.manual_seed(seed)
    model = CloverForBlockDiffusion(config)
    model.lm_head.weight.data *= 40.0
    model.save_pretrained(folder)
    return clover.load(folder)


def tools_server_fixtures(folder_name: str):
    """Module-scoped fixtures (loaded, server, client) of a `clover serve` app on `tools_model` (block 4,
    threshold 0.5): a test module binds them with `loaded, server, client = tools_server_fixtures(...)`."""
    import pytest

    from clover.api import eos_ids
    from clover.server import Settings, create_app

    @pytest.fixture(scope="module")
    def loaded(tmp_path_factory):
        return tools_model(tmp_path_factory.mktemp(folder_name))

    @pytest.fixture(scope="module")
    def server(loaded):
        model, tokenizer = loaded
        settings = Settings(model_id="tiny", block_size=4, threshold=0.5, max_batch=8, max_queue=16)
        with RunningServer(create_app(model, tokenizer, settings, eos_ids(model, tokenizer))) as s:
            yield s

    @pytest.fixture(scope="module")
    def client(server):
        return globals()["client"](server)

    return loaded, server, client

