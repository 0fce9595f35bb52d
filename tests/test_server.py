"""`clover serve`: the OpenAI-compatible server on a tiny random model, driven by the official
`openai` client (sync and async, streamed and not) and by raw HTTP for the error cases."""

import asyncio
import http.client
import json
import re
import threading
import time
from dataclasses import replace

import openai
import pytest

import clover
from clover.chat import call_frame_ids, encode, split_thinking
from clover.api import decode_config, eos_ids, result
from clover.engine import Engine
from clover.cli import main
from clover.server import Settings, create_app
from helpers import save_tiny_model
from server_utils import RunningServer, client, metric, raw

BLOCK = 4
THRESH = 0.5


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("serve-model"))
    model, tokenizer = clover.load(folder)
    return model, tokenizer


def make_app(loaded, **kw):
    model, tokenizer = loaded
    settings = Settings(**{"model_id": "tiny", "block_size": BLOCK, "threshold": THRESH, "max_batch": 32,
                           "max_queue": 64, **kw})
    return create_app(model, tokenizer, settings, eos_ids(model, tokenizer))


@pytest.fixture(scope="module")
def server(loaded):
    with RunningServer(make_app(loaded)) as s:
        yield s


def reference(loaded, prompt, max_tokens, chat=False, think=False, block_size=BLOCK):
    """The single-request greedy output through the Python API (no server). Chat without tools: the
    server never lets the model write a tool-call frame, so neither does the reference."""
    model, tokenizer = loaded
    if isinstance(prompt, str) and not (chat or think):
        return clover.generate(model, tokenizer, prompt, max_new_tokens=max_tokens, block_size=block_size,
                               threshold=THRESH)
    cfg = decode_config(model, tokenizer, max_new_tokens=max_tokens, block_size=block_size, threshold=THRESH)
    cfg = replace(cfg, sampling=replace(cfg.sampling, suppress=call_frame_ids(tokenizer)))
    return result(Engine(model, cfg).generate([encode(tokenizer, prompt, chat=True, think=think)])[0], tokenizer, think)


def test_models_health_and_sync_client(server, loaded):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert raw(server, "GET", "/health")[0] == 200
    ref = reference(loaded, "Hello there", 20)
    got = c.completions.create(model="tiny", prompt="Hello there", max_tokens=20)
    assert got.choices[0].text == ref.text and got.choices[0].finish_reason == ref.finish_reason
    assert got.usage.completion_tokens == len(ref.token_ids) and got.usage.prompt_tokens > 0
    parts = [ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="Hello there", max_tokens=20,
                                                               stream=True)]
    assert "".join(parts) == ref.text and len(parts) >= 2  # block by block

    chat_ref = reference(loaded, [{"role": "user", "content": "Hi!"}], 16)
    got = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=16)
    assert got.choices[0].message.content == chat_ref.text and got.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat_ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(chat_ref.token_ids)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == chat_ref.finish_reason


def test_async_client_thinking_and_clover_fields(server, loaded):
    messages = [{"role": "user", "content": "2+2?"}]
    ref = reference(loaded, messages, 24, think=True)
    ref_reasoning, ref_answer = split_thinking(ref.text)

    async def go():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        one = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        reasoning, content = "", ""
        async for ch in await c.chat.completions.create(
                model="tiny", messages=messages, max_tokens=24, stream=True,
                extra_body={"chat_template_kwargs": {"enable_thinking": True}}):
            delta = ch.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
        other = await c.completions.create(model="tiny", prompt="abc", max_tokens=12,
                                           extra_body={"block_size": 8, "threshold": 0.5, "mode": "low_confidence"})
        await c.close()
        return one, reasoning, content, other

    one, reasoning, content, other = asyncio.run(go())
    msg = one.choices[0].message
    if ref_reasoning is None:  # the random model never closed its think block
        assert msg.reasoning_content == ref.text.replace("<think>", "", 1).strip() and msg.content == ""
    else:
        assert (msg.reasoning_content, msg.content) == (ref_reasoning, ref_answer)
    assert reasoning.strip() == msg.reasoning_content and content == msg.content
    model, tokenizer = loaded
    ref8 = clover.generate(model, tokenizer, "abc", max_new_tokens=12, block_size=8, threshold=0.5)
    assert other.choices[0].text == ref8.text


def test_lookup_drafts_reach_the_engine_and_reply_as_ar(server, loaded):
    body = {"prompt": "abab abab abab", "max_tokens": 40, "ignore_eos": True}
    status, _, text = raw(server, "POST", "/v1/completions", {**body, "mode": "self_spec", "draft": "lookup"})
    model, tokenizer = loaded
    ar = clover.generate(model, tokenizer, body["prompt"], max_new_tokens=40, mode="ar", ignore_eos=True)
    assert status == 200 and json.loads(text)["choices"][0]["text"] == ar.text


PROMPTS = [f"{w} {i}" for i, w in enumerate(("apple", "Bob", "cat", "dog", "eel", "fig", "gnu", "hat") * 4)]


def test_32_concurrent_streams_equal_single_requests(server, loaded):
    budgets = [8 + 4 * (i % 5) for i in range(len(PROMPTS))]  # rows of different lengths leave at different times
    refs = [reference(loaded, p, n).text for p, n in zip(PROMPTS, budgets)]

    async def one(c, prompt, n):
        text, chunks = "", 0
        async for ch in await c.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=True):
            text += ch.choices[0].text
            chunks += 1
        return text

    async def go():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = await asyncio.gather(*(one(c, p, n) for p, n in zip(PROMPTS, budgets)))
        await c.close()
        return out

    forwards0 = metric(server, "clover_model_forwards_total")
    got = asyncio.run(go())
    assert got == refs
    forwards = metric(server, "clover_model_forwards_total") - forwards0
    assert forwards < sum(budgets) / 2  # batched: far fewer forwards than one per row per step
    wait_for(lambda: metric(server, "clover_running_rows") == 0 and metric(server, "clover_queue_length") == 0)


def _stream_and_hang_up(server, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: ")
    return conn


def wait_for(fn, timeout=20.0):
    deadline = time.time() + timeout
    while not fn():
        if time.time() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_the_slot(server):
    cancelled0 = metric(server, "clover_cancelled_rows_total")
    conn = _stream_and_hang_up(server, {"prompt": "long story", "max_tokens": 900, "ignore_eos": True, "stream": True})
    wait_for(lambda: metric(server, "clover_running_rows") == 1)
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: metric(server, "clover_running_rows") == 0)
    assert metric(server, "clover_cancelled_rows_total") == cancelled0 + 1


def test_stop_strings_n_and_seed(server, loaded):
    c = client(server)
    ref = reference(loaded, "Hello there", 24)
    stop = ref.text[5:7]
    cut = ref.text[: ref.text.find(stop)]
    got = c.completions.create(model="tiny", prompt="Hello there", max_tokens=24, stop=[stop, "zzzz"])
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="Hello there", max_tokens=24, stop=stop, stream=True))
    assert streamed == cut
    three = c.completions.create(model="tiny", prompt="Hello there", max_tokens=12, n=3)
    assert [ch.index for ch in three.choices] == [0, 1, 2] and len({ch.text for ch in three.choices}) == 1
    texts = {0: "", 1: ""}
    for ch in c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "yo"}], max_tokens=10, n=2,
                                        stream=True):
        texts[ch.choices[0].index] += ch.choices[0].delta.content or ""
    assert texts[0] == texts[1] == reference(loaded, [{"role": "user", "content": "yo"}], 10).text
    a, b = (c.completions.create(model="tiny", prompt="Hi", max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


LONG = "x" * 1100
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    # (what, path, body, status, param or code that must be named)
    ("malformed JSON", "/v1/chat/completions", '{"messages": [', 400, None),
    ("not an object", "/v1/completions", "[1, 2]", 400, None),
    ("wrong type", "/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("wrong type max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": -5}, 400, "max_tokens"),
    ("missing prompt", "/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, 404, "model"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("prompt too long", "/v1/completions", {"prompt": LONG, "max_tokens": 4}, 400, "context_length_exceeded"),
    ("prompt + max_tokens too long", "/v1/completions", {"prompt": "x" * 1000, "max_tokens": 100}, 400, "max_tokens"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("temperature < 0", "/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("block_size too big", "/v1/completions", {"prompt": "a", "block_size": 4096}, 400, "block_size"),
    ("unknown mode", "/v1/completions", {"prompt": "a", "mode": "telepathy"}, 400, "mode"),
    ("self_spec sampling", "/v1/completions", {"prompt": "a", "mode": "self_spec", "temperature": 0.5}, 400, None),
    ("unknown draft", "/v1/completions", {"prompt": "a", "mode": "self_spec", "draft": "oracle"}, 400, "draft"),
    ("logprobs", "/v1/completions", {"prompt": "a", "logprobs": 3}, 400, "logprobs"),
    ("n too big", "/v1/completions", {"prompt": "a", "n": 1000}, 400, "n"),
    ("unknown route", "/v1/embeddings", {"input": "a"}, 404, None),
]


@pytest.mark.parametrize("what,path,body,status,named", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(server, what, path, body, status, named):
    got, _, text = raw(server, "POST", path, body)
    assert got == status, text
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if named:
        assert named in (err["param"], err["code"]), err


def test_api_key_and_queue_full(loaded):
    with RunningServer(make_app(loaded, api_key="s3cret", max_batch=1, max_queue=1)) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            status, _, text = raw(s, "POST", "/v1/completions", {"prompt": "a"}, headers)
            assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
        assert raw(s, "GET", "/v1/models")[0] == 401 and raw(s, "GET", "/health")[0] == 200
        with pytest.raises(openai.AuthenticationError):
            client(s, api_key="wrong").models.list()
        assert client(s, api_key="s3cret").completions.create(model="tiny", prompt="ab", max_tokens=4).choices

        auth = {"Authorization": "Bearer s3cret"}
        long = {"prompt": "long", "max_tokens": 900, "ignore_eos": True, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(long), headers={"Content-Type": "application/json", **auth})
        assert conn.getresponse().status == 200
        wait_for(lambda: metric(s, "clover_running_rows") == 1)
        waiting = threading.Thread(target=raw, args=(s, "POST", "/v1/completions", {"prompt": "b", "max_tokens": 4}, auth))
        waiting.start()
        wait_for(lambda: metric(s, "clover_queue_length") == 1)
        status, headers, text = raw(s, "POST", "/v1/completions", {"prompt": "c", "max_tokens": 4}, auth)
        assert status == 503 and headers.get("retry-after") == "1" and json.loads(text)["error"]["code"] == "queue_full"
        conn.close()  # the long stream goes away -> the waiting request runs
        waiting.join(timeout=30)
        assert not waiting.is_alive()
        assert metric(s, "clover_rejected_queue_full_total") == 1


def test_metrics_and_playground_page(server):
    assert raw(server, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 16})[0] == 200
    status, headers, text = raw(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("clover_requests_total{", "clover_generated_tokens_total", "clover_tokens_per_forward",
                 "clover_queue_length", "clover_request_latency_seconds_bucket", "clover_time_to_first_block_seconds"):
        assert name in text
    assert metric(server, "clover_tokens_per_forward") > 1  # several tokens per forward on the peaked model
    status, headers, page = raw(server, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # no CDN: everything inline


def test_live_chunks_carry_the_block_view(server):
    status, _, text = raw(server, "POST", "/v1/completions",
                          {"prompt": "Hello", "max_tokens": 16, "stream": True, "clover_live": True})
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    blocks = [e["clover"]["block"] for e in events if "block" in e.get("clover", {})]
    committed = [p for e in events for p in e.get("clover", {}).get("committed", [])]
    assert blocks and any(None in [t for t, _ in b] for b in blocks)  # masked slots seen while denoising
    assert len(committed) == 16 and all(isinstance(s, int) for _, s in committed)
    assert text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("argv,needle", [
    (["--port", "70000"], "--port"),
    (["--max-batch", "0"], "--max-batch"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--mode", "bogus"], "unknown mode"),
    (["--threshold", "2"], "threshold"),
    (["--model", "/nonexistent/model"], "no config.json"),
    (["--block-size", "0"], "block_size must be >= 1, got 0"),
    (["--block-size", "-3"], "block_size must be >= 1, got -3"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
    (["--max-tool-calls", "0"], "--max-tool-calls must be >= 1, got 0"),
    (["--stream-interval-ms", "-1"], "--stream-interval-ms must be in [0, 1000], got -1"),
    (["--served-model-name", ""], "--served-model-name"),
    (["--compile-cache", "/tmp"], "--compile-cache needs --runner compiled"),
    (["--runner", "compiled", "--compile-cache", "/proc/no-such-dir"], "--compile-cache: cannot use"),
])
def test_serve_flag_mistakes_are_one_line(capsys, argv, needle):
    code = main(["serve", *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1 and err.startswith("clover serve: error:")
    assert "Traceback" not in err
