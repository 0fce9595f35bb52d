"""Faults one request must never cause for another, and user mistakes that must be a clear 4xx (issue 21):
bad fields (seed range, lone surrogates) at the edge, the body-size limit, prompt encoding off the event
loop (/health answers while a prompt is being encoded or a long generation runs), a poisoned request
among concurrent streams (admission and step failures stay with their request), no tool-call frame
without tools (server and `clover chat`), `CLOVER_API_KEY`, `clover serve` flag validation, served
model aliases and the lm-eval command of docs/evaluation.md. Official `openai` client and raw HTTP."""

import asyncio
import http.client
import json
import shlex
import threading
from dataclasses import replace
from pathlib import Path

import openai
import pytest
import torch

import clover
from clover.chat import call_frame_ids
from clover.api import decode_config, eos_ids
from clover.cli import build_parser, main
from clover.cli import serve as serve_cli
from clover.cli.chat import ReplyView
from clover.engine import Engine
from clover.server import Settings, create_app
from clover.server.scheduler import RowJob as Job, Ticket
from clover.server.routes import INLINE_BODY_BYTES
from clover.settings import DecodeConfig
from server_utils import RunningServer, client, metric, raw

BLOCK = 4
THRESH = 0.5
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def loaded(model_dir):
    return clover.load(model_dir)


def make_app(model, tokenizer, **kw):
    settings = Settings(**{"model_id": "tiny", "block_size": BLOCK, "threshold": THRESH, "max_batch": 32,
                           "max_queue": 64, **kw})
    return create_app(model, tokenizer, settings, eos_ids(model, tokenizer))


@pytest.fixture(scope="module")
def server(loaded):
    with RunningServer(make_app(*loaded, max_body_bytes=64 * 1024)) as s:
        yield s


def solo(loaded, prompt, max_tokens):
    """One request alone through the Python API: what the server must return for it, whatever runs beside."""
    model, tokenizer = loaded
    return clover.generate(model, tokenizer, prompt, max_new_tokens=max_tokens, block_size=BLOCK, threshold=THRESH)


def assert_error(text, status, got_status, param=None, code=None, type_="invalid_request_error"):
    assert got_status == status, text
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"] == type_, err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


class Wrapped:
    """The model with its forward changed (a poison that raises, or a logit boost); everything else is
    the model's own."""

    def __init__(self, model, hook):
        self._model, self._hook = model, hook

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, ids, **kw):
        return self._hook(self._model, ids, **kw)


# ---- 1. seed: a 64-bit signed integer, checked at the edge --------------------------------------------------
SEEDS_BAD = [2**64, 2**63, -2**63 - 1, 10**30]


@pytest.mark.parametrize("seed", SEEDS_BAD)
def test_seed_out_of_range_is_400_naming_seed(server, seed):
    body = {"prompt": "a", "max_tokens": 4, "temperature": 0.9, "seed": seed}
    status, _, text = raw(server, "POST", "/v1/completions", body)
    assert_error(text, 400, status, param="seed")
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               temperature=0.9, seed=seed, max_tokens=4)
    assert e.value.body["param"] == "seed"


def test_seed_bounds_are_accepted(server):
    c = client(server)
    for seed in (2**63 - 1, -2**63, 0):
        a, b = (c.completions.create(model="tiny", prompt="Hi", max_tokens=8, temperature=0.9, seed=seed)
                for _ in range(2))
        assert a.choices[0].text == b.choices[0].text  # seeded: reproducible


# ---- 2. lone surrogates: 400 naming the field ---------------------------------------------------------------
SURROGATES = [
    ("/v1/completions", '{"prompt": "ab\\ud800c"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt.1"),
    ("/v1/completions", '{"prompt": "ok", "stop": ["\\ud800"]}', "stop.0"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": '
                             '[{"type": "text", "text": "x\\udc00"}]}]}', "messages.1.content.0.text"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "ok"}], "user": "\\ud800"}', "user"),
    ("/v1/decide", '{"material": "\\ud800", "questions": [{"question": "x?", "options": ["a", "b"]}]}', "material"),
]


@pytest.mark.parametrize("path,body,param", SURROGATES, ids=[s[2] for s in SURROGATES])
def test_lone_surrogate_is_400(server, path, body, param):
    status, _, text = raw(server, "POST", path, body)
    assert_error(text, 400, status, param=param, code="invalid_value")
    assert "surrogate" in json.loads(text)["error"]["message"]


def test_lone_surrogate_through_the_openai_client_and_pairs_are_fine(server, loaded):
    # the official Python client cannot send one (it encodes the body as UTF-8 first); clients that write
    # JSON's "\ud800" escape (JavaScript's JSON.stringify, raw HTTP) can: those get the 400 above
    with pytest.raises(UnicodeEncodeError):
        client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x\ud800"}],
                                               max_tokens=4)
    assert raw(server, "GET", "/health")[0] == 200
    # a real surrogate pair (JSON "\ud83d\ude00" = U+1F600) is ordinary text
    status, _, text = raw(server, "POST", "/v1/completions", '{"prompt": "smile \\ud83d\\ude00", "max_tokens": 8}')
    assert status == 200 and json.loads(text)["choices"][0]["text"] == solo(loaded, "smile \U0001F600", 8).text


# ---- 3. body-size limit, encoding off the event loop, /health while busy -------------------------------------
def test_body_over_the_limit_is_413(server):
    big = {"prompt": "x" * (70 * 1024), "max_tokens": 4}  # the server's limit here: 64 KiB
    status, headers, text = raw(server, "POST", "/v1/completions", big)
    assert_error(text, 413, status, code="request_too_large")
    assert "64" in json.loads(text)["error"]["message"] or "65536" in json.loads(text)["error"]["message"]
    # chunked upload (no Content-Length): counted as it arrives
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    chunks = (json.dumps(big)[i:i + 8192].encode() for i in range(0, len(json.dumps(big)), 8192))
    conn.request("POST", "/v1/completions", body=chunks, headers={"Content-Type": "application/json"},
                 encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()
    with pytest.raises(openai.APIStatusError) as e:
        client(server).completions.create(model="tiny", prompt="x" * (70 * 1024), max_tokens=4)
    assert e.value.status_code == 413
    # under the limit: served (here the prompt is too long for the context, a 400, not a 413)
    status, _, text = raw(server, "POST", "/v1/completions", {"prompt": "x" * (60 * 1024), "max_tokens": 4})
    assert_error(text, 400, status, code="context_length_exceeded")
    assert raw(server, "GET", "/health")[0] == 200


class SlowTokenizer:
    """The tokenizer, but encoding text that contains STALL waits until released (a huge prompt)."""

    STALL = "STALL"

    def __init__(self, tokenizer):
        self._tok, self.entered, self.release = tokenizer, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, text, *a, **kw):
        if self.STALL in text:
            self.entered.set()
            assert self.release.wait(60)
        return self._tok(text, *a, **kw)


def test_health_answers_while_a_prompt_is_encoded_and_while_generating(loaded):
    model, tokenizer = loaded
    slow = SlowTokenizer(tokenizer)
    with RunningServer(make_app(model, slow)) as s:
        got = {}
        # a body over INLINE_BODY_BYTES (a long `user` field): encoded in the encoder thread, not on the loop
        big = {"prompt": "STALL here", "max_tokens": 4, "user": "u" * (INLINE_BODY_BYTES + 1)}
        stalled = threading.Thread(target=lambda: got.update(r=raw(s, "POST", "/v1/completions", big)))
        stalled.start()
        assert slow.entered.wait(30)
        for _ in range(3):  # the event loop is free: health, metrics, models and errors answer at once
            status, _, text = raw(s, "GET", "/health", timeout=5)
            assert status == 200 and json.loads(text)["status"] == "ok"
        assert raw(s, "GET", "/v1/models", timeout=5)[0] == 200
        assert raw(s, "POST", "/v1/completions", {"prompt": "a", "seed": 2**64}, timeout=5)[0] == 400
        slow.release.set()
        stalled.join(30)
        assert got["r"][0] == 200

        # a long generation runs in the scheduler thread: health still answers
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "long", "max_tokens": 900, "stream": True,
                                                                 "ignore_eos": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")
        for _ in range(3):
            status, _, text = raw(s, "GET", "/health", timeout=5)
            assert status == 200 and json.loads(text)["running_rows"] == 1
        conn.close()


# ---- 1 + step isolation: one poisoned request among 8 concurrent streams ------------------------------------
POISON = 120  # a token id (`<unused..>` in the test tokenizer): any forward that sees it raises


def poisoned(model, ids, **kw):
    if bool((ids == POISON).any()):
        raise RuntimeError("poisoned row")
    return model(ids, **kw)


STREAMS = [("apple pie", 40), ("Bob said", 36), ("cat 7", 44), ("dog days", 32), ("eel!", 40), ("fig tree", 48),
           ("gnu 3", 36)]


def test_poisoned_request_among_8_streams_leaves_the_other_7_identical(loaded):
    model, tokenizer = loaded
    refs = [solo(loaded, p, n) for p, n in STREAMS]
    # the poison is in no healthy row: their windows hold only their prompts and these tokens
    assert not any(POISON in r.token_ids for r in refs)
    with RunningServer(make_app(Wrapped(model, poisoned), tokenizer)) as s:
        async def one(c, prompt, n, started):
            text, finish = "", None
            async for ch in await c.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=True):
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
                started.set()
            return text, finish

        async def poison_one(c, others_started):
            await asyncio.gather(*(e.wait() for e in others_started))  # the 7 are mid-generation
            with pytest.raises(openai.APIError) as e:
                async for _ in await c.completions.create(model="tiny", prompt=[30, 31, POISON], max_tokens=40,
                                                          stream=True):
                    pass
            return e.value

        async def go():
            c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
            started = [asyncio.Event() for _ in STREAMS]
            out = await asyncio.gather(*(one(c, p, n, e) for (p, n), e in zip(STREAMS, started)),
                                       poison_one(c, started))
            await c.close()
            return out

        *got, error = asyncio.run(go())
        assert [t for t, _ in got] == [r.text for r in refs]  # byte-identical to each request alone
        assert [f for _, f in got] == [r.finish_reason for r in refs]
        assert "internal error" in str(error.message)
        assert metric(s, "clover_failed_rows_total") == 1
        assert metric(s, "clover_isolated_rows_total") >= 2  # the step that raised was a batched one

        # raw HTTP, not streamed: the poisoned request is a 500 in OpenAI's shape, a normal one is served
        status, _, text = raw(s, "POST", "/v1/completions", {"prompt": [7, POISON], "max_tokens": 8})
        assert_error(text, 500, status, type_="server_error")
        status, _, text = raw(s, "POST", "/v1/completions", {"prompt": "apple pie", "max_tokens": 40})
        assert status == 200 and json.loads(text)["choices"][0]["text"] == refs[0].text


def test_after_a_failed_step_only_the_suspect_leaves_the_batch(loaded):
    """Driven step by step (no threads): rows that stepped fine are rebuilt as one batch; the row that
    joined just before the failing step goes solo and fails there."""
    model, tokenizer = loaded
    app = make_app(Wrapped(model, poisoned), tokenizer)
    sched, loop = app.state.scheduler, asyncio.new_event_loop()
    key = DecodeConfig(block_size=BLOCK, threshold=THRESH).engine_key()
    good = [Job(Ticket(loop), 0, tokenizer(p).input_ids, n, key) for p, n in STREAMS[:3]]
    bad = Job(Ticket(loop), 0, [30, 31, POISON], 16, key)
    try:
        with torch.inference_mode():
            sched._admit(good)
            sched._step(key)
            assert all(j.proven for j in good)
            sched._admit([bad])
            sched._step(key)  # raises inside: isolated
            assert set(sched.engines) == {key, (key, id(bad))} and len(sched.engines[key].seqs) == 3
            for slot in list(sched.engines):
                sched._step(slot)
            assert bad.state == "done" and set(sched.engines) == {key}
            while sched.engines:
                sched._step(key)
        texts = [tokenizer.decode(j.seq.token_ids, skip_special_tokens=True) for j in good]
        assert texts == [solo(loaded, p, n).text for p, n in STREAMS[:3]]
        loop.run_until_complete(asyncio.sleep(0))
        items = []
        while not bad.ticket.queue.empty():
            items.append(bad.ticket.queue.get_nowait())
        assert [i[0] for i in items] == ["error"]
    finally:
        loop.close()


LATE = STREAMS + [("hat trick", 44)]


def test_a_row_that_fails_mid_generation_leaves_the_others_identical(loaded):
    """The forward raises on a token one stream generates halfway (every row has then stepped fine, so
    none is a suspect): all rows go solo, that stream fails there, the 7 others finish as alone."""
    model, tokenizer = loaded
    refs = [solo(loaded, p, n) for p, n in LATE]
    seen = [set(tokenizer(p).input_ids) | set(r.token_ids) for (p, _), r in zip(LATE, refs)]
    candidates = [(t, k) for k, r in enumerate(refs) for t in r.token_ids[: len(r.token_ids) - BLOCK]
                  if sum(t in x for x in seen) == 1]
    assert candidates, "no token generated by one stream only (change LATE)"
    bad_token, victim = candidates[0]

    def late_poison(m, ids, **kw):
        if bool((ids == bad_token).any()):
            raise RuntimeError("late poison")
        return m(ids, **kw)

    with RunningServer(make_app(Wrapped(model, late_poison), tokenizer)) as s:
        async def one(c, prompt, n):
            text = ""
            try:
                async for ch in await c.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=True):
                    text += ch.choices[0].text
            except openai.APIError as e:
                return ("error", text, str(e.message))
            return text

        async def go():
            c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
            out = await asyncio.gather(*(one(c, p, n) for p, n in LATE))
            await c.close()
            return out

        got = asyncio.run(go())
        assert got[victim][0] == "error" and refs[victim].text.startswith(got[victim][1])  # what it sent was right
        assert [g for k, g in enumerate(got) if k != victim] == [r.text for k, r in enumerate(refs) if k != victim]
        assert metric(s, "clover_failed_rows_total") == 1 and metric(s, "clover_isolated_rows_total") >= 2


def test_admission_failures_end_only_their_own_job(loaded):
    """The issue's case: a seed the generator cannot take (>= 2**64) raised while the scheduler admitted
    the job and failed every running request. Submitted past the HTTP edge (which now refuses it), and
    beside it a job that cannot fit its engine (prompt + budget beyond the context) in one admission group
    with a good one."""
    model, tokenizer = loaded
    app = make_app(model, tokenizer)
    scheduler = app.state.scheduler
    ref = solo(loaded, "apple pie", 40)
    with RunningServer(app) as s:
        async def go():
            c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
            stream = await c.completions.create(model="tiny", prompt="apple pie", max_tokens=40, stream=True)
            text = ""
            loop = asyncio.get_running_loop()
            bad_seed = Job(Ticket(loop), 0, [5, 6], 8, DecodeConfig.from_settings(
                block_size=BLOCK, threshold=THRESH, temperature=0.5, seed=2**64).engine_key())
            key = DecodeConfig(block_size=BLOCK, threshold=THRESH).engine_key()
            too_long = Job(Ticket(loop), 0, [5] * 10, model.config.max_position_embeddings, key)
            good = Job(Ticket(loop), 1, tokenizer("Bob said").input_ids, 36, key)
            async for ch in stream:
                if not text:
                    scheduler.submit([bad_seed])
                    scheduler.submit([too_long, good])  # one group, one engine: only too_long fails
                text += ch.choices[0].text
            await c.close()
            errors = [await asyncio.wait_for(j.ticket.queue.get(), 30) for j in (bad_seed, too_long)]
            good_items = []
            while not good_items or good_items[-1][5] is None:
                good_items.append(await asyncio.wait_for(good.ticket.queue.get(), 30))
            return text, errors, good_items[-1]

        text, errors, last = asyncio.run(go())
        assert text == ref.text
        assert [e[0] for e in errors] == ["error", "error"]
        assert tokenizer.decode(last[2], skip_special_tokens=True) == solo(loaded, "Bob said", 36).text
        assert metric(s, "clover_failed_rows_total") == 2


# ---- no tool-call frame without tools (one mechanism: SamplingParams.suppress) ---------------------------------
def tool_call_lover(tokenizer):
    """A forward whose logits favour <tool_call> everywhere: without the mask every reply would call."""
    tid = tokenizer.convert_tokens_to_ids("<tool_call>")

    def hook(model, ids, **kw):
        out = model(ids, **kw)
        out.logits[..., tid] += 1e4
        return out
    return hook


@pytest.mark.parametrize("mode", ["ar", "low_confidence"])
def test_suppressed_tokens_are_never_generated(loaded, mode):
    model, tokenizer = loaded
    lover = Wrapped(model, tool_call_lover(tokenizer))
    frame = call_frame_ids(tokenizer)
    assert frame == tuple(sorted(tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])))
    prompts = [tokenizer("Hello there").input_ids, tokenizer("a b c d e").input_ids[:5]]  # batch of 2, odd lengths
    cfg = decode_config(model, tokenizer, max_new_tokens=13, block_size=4, threshold=THRESH, mode=mode)
    free = Engine(lover, cfg).generate(prompts)
    assert all(frame[0] in s.token_ids for s in free)  # the boost works: without the mask, calls
    masked_cfg = replace(cfg, sampling=replace(cfg.sampling, suppress=frame))
    masked = Engine(lover, masked_cfg).generate(prompts)
    assert all(not set(frame) & set(s.token_ids) and len(s.token_ids) > 0 for s in masked)
    # sampled too
    sampled_cfg = replace(masked_cfg, sampling=replace(masked_cfg.sampling, temperature=1.0, seed=3))
    assert all(not set(frame) & set(s.token_ids) for s in Engine(lover, sampled_cfg).generate(prompts))


def test_chat_without_tools_writes_no_tool_call(loaded):
    model, tokenizer = loaded
    with RunningServer(make_app(Wrapped(model, tool_call_lover(tokenizer)), tokenizer)) as s:
        c = client(s)
        msgs = [{"role": "user", "content": "Hello!"}]
        for mode in ("low_confidence", "ar"):
            got = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, extra_body={"mode": mode})
            assert "<tool_call>" not in got.choices[0].message.content and not got.choices[0].message.tool_calls
            streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model="tiny", messages=msgs, max_tokens=12, stream=True, extra_body={"mode": mode}))
            assert streamed == got.choices[0].message.content
        status, _, text = raw(s, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 12})
        assert status == 200 and "tool_call" not in text
        # with tools offered the frame is allowed (here the boosted model calls at once)
        tools = [{"type": "function", "function": {"name": "get_age", "parameters": {"type": "object"}}}]
        got = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, tools=tools)
        assert "<tool_call>" in (got.choices[0].message.content or "") or got.choices[0].message.tool_calls


def test_clover_chat_masks_the_frame_and_styles_thinking(loaded, model_dir, monkeypatch, capsys):
    model, tokenizer = loaded
    import clover.api

    monkeypatch.setattr(clover.api, "load", lambda *a, **k: (Wrapped(model, tool_call_lover(tokenizer)), tokenizer))
    lines = iter(["Hello!", "/think", "what did I just ask", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", model_dir, "--max-new-tokens", "12", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "<tool_call>" not in out and "</tool_call>" not in out and "<think>" not in out


def test_reply_view_shows_thinking_without_tags():
    texts = ["<think>\nwe", "<think>\nwe need 4", "<think>\nwe need 4.</think>\n\nIt is", "<think>\nwe need 4.</think>\n\nIt is 4."]
    for tty, opened, between in ((True, "\x1b[2m", "\x1b[0m\n\n"), (False, "[thinking]\n", "\n[answer]\n")):
        view = ReplyView(think=True, tty=tty)
        shown = "".join(view.update(t) for t in texts) + view.update(texts[-1], final=True)
        assert shown == f"{opened}we need 4.{between}It is 4."
        assert "<think>" not in shown and "</think>" not in shown
    view = ReplyView(think=True, tty=False)  # never closed: the reasoning, then nothing more
    assert view.update("<think>\nhmm ") + view.update("<think>\nhmm ", final=True) == "[thinking]\nhmm \n[answer]\n"
    view = ReplyView(think=False, tty=True)  # without thinking, stray tags are not shown either
    assert view.update("a<think>b</think>c") == "abc"


# ---- 4, 5: clover serve's flags and CLOVER_API_KEY -----------------------------------------------------------
def test_serve_decoding_flags_get_generate_s_checks(capsys):
    """--block-size 0 used to start silently with the model's 32 (tests/test_server.py has the other flags)."""
    for argv in (["--block-size", "0"], ["--block-size", "-3"], ["--threshold", "-0.5"], ["--mode", "bogus"]):
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert main(["generate", "--prompt", "x", *argv]) == 2  # the same check, the same message
        assert capsys.readouterr().err.split("error:", 1)[1] == err.split("error:", 1)[1], argv


def test_api_key_from_the_environment(monkeypatch):
    args = build_parser().parse_args(["serve"])
    monkeypatch.delenv("CLOVER_API_KEY", raising=False)
    assert serve_cli.api_key(args) is None
    monkeypatch.setenv("CLOVER_API_KEY", "from-env")
    assert serve_cli.api_key(args) == "from-env"
    assert serve_cli.api_key(build_parser().parse_args(["serve", "--api-key", "flag"])) == "flag"  # the flag wins
    monkeypatch.setenv("CLOVER_API_KEY", "")
    assert serve_cli.api_key(args) is None  # empty = unset


def test_clover_serve_env_key_aliases_and_body_limit(model_dir, monkeypatch, capsys):
    """`clover serve` itself (in-process; uvicorn's run is replaced by handing over the app it got):
    the key from CLOVER_API_KEY (nothing on the command line), two served names, a small body limit."""
    import uvicorn

    apps = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: (apps.append(self.config.app),
                                                                             [s.close() for s in sockets or []]))
    monkeypatch.setenv("CLOVER_API_KEY", "s3cret")
    argv = ["serve", "--model", model_dir, "--port", "0", "--block-size", "4", "--threads", "1",
            "--served-model-name", "tiny", "clover", "--max-body-bytes", "4096"]
    assert main(argv) == 0 and "s3cret" not in " ".join(argv)
    assert "clover serve: tiny on http://127.0.0.1:" in capsys.readouterr().out
    monkeypatch.undo()  # uvicorn's own run again, for the test server
    with RunningServer(apps[0]) as s:
        assert raw(s, "POST", "/v1/completions", {"prompt": "a"})[0] == 401
        c = client(s, api_key="s3cret")
        assert [m.id for m in c.models.list().data] == ["tiny", "clover"]
        for name in ("tiny", "clover"):
            got = c.completions.create(model=name, prompt="ab", max_tokens=4)
            assert got.model == "tiny" and got.choices[0].text is not None
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="gpt-9", prompt="ab", max_tokens=4)
        status, _, text = raw(s, "POST", "/v1/completions", {"prompt": "x" * 5000}, {"Authorization": "Bearer s3cret"})
        assert_error(text, 413, status, code="request_too_large")


# ---- docs/evaluation.md: the lm-eval commands against `clover serve` name a model the server serves -----------
def doc_commands():
    text = (ROOT / "docs" / "evaluation.md").read_text()
    section = text[text.index("## lm-eval against `clover serve`"):]
    section = section[: section.index("\n## ", 1)]
    lines = [ln.strip() for ln in section.replace("\\\n", " ").splitlines() if ln.strip()]
    serve = next(shlex.split(ln.rstrip("&").strip()) for ln in lines if ln.startswith("clover serve"))
    evals = [shlex.split(ln) for ln in lines if ln.startswith("lm-eval run")]
    return serve, evals


def test_the_documented_lm_eval_commands_name_a_served_model(loaded, model_dir):
    """Each documented `lm-eval run --model local-(chat-)completions` names a model the documented
    `clover serve` serves, and the request lm-eval builds from those model_args (its own payload) is served."""
    registry = pytest.importorskip("lm_eval.api.registry", reason="lm-eval is not installed")
    serve, evals = doc_commands()
    assert serve[:2] == ["clover", "serve"] and len(evals) == 2
    args = build_parser().parse_args([a.replace("DIR", model_dir) for a in serve[1:]])
    names = serve_cli.served_names(args)
    model, tokenizer = loaded
    with RunningServer(make_app(model, tokenizer, model_id=names[0], aliases=tuple(names[1:]))) as s:
        for argv in evals:
            kind = argv[argv.index("--model") + 1]
            model_args = dict(kv.split("=", 1) for kv in argv[argv.index("--model_args") + 1].split(","))
            assert model_args["model"] in names, (model_args["model"], names)
            path = "/" + model_args["base_url"].split("/", 3)[3]
            model_args = {k: v.replace("DIR", model_dir) for k, v in model_args.items()}
            model_args.update(base_url=s.url + path, max_retries=1)
            lm = registry.get_model(kind)(**model_args)
            prompt = [{"role": "user", "content": "Q: a"}] if "chat" in kind else ["Q: a\nA:"]
            body = lm._create_payload(prompt, generate=True, gen_kwargs={"until": ["\n"], "max_gen_toks": 8})
            status, _, text = raw(s, "POST", path, body)
            assert status == 200, text
            assert lm.parse_generations(json.loads(text)) and json.loads(text)["model"] == names[0]


# ---- issue 53, item 7: strict types as OpenAI's; a request that can never fit the queue is a 400 ----------------
STRICT_BAD = [
    ("/v1/completions", {"prompt": "a", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": "2"}, "n"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "a", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": [1, True]}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "4"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": 1}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2.0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "8"},
     "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,param", STRICT_BAD, ids=[f"{b}" for _, b, _ in STRICT_BAD])
def test_strict_types_are_400_naming_the_field(server, path, body, param):
    status, _, text = raw(server, "POST", path, body)
    assert_error(text, 400, status, code="invalid_value")
    if param is not None:
        assert json.loads(text)["error"]["param"] == param
    else:
        assert json.loads(text)["error"]["param"].startswith("prompt")


def test_strict_types_through_the_openai_client(server):
    c = client(server)
    for kw, param in ((dict(max_tokens="4"), "max_tokens"), (dict(n="2"), "n"), (dict(stream="yes"), "stream")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="Hi", **kw)
        assert e.value.body["param"] == param
    assert c.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=1).choices  # an int for a float


def test_a_request_that_can_never_fit_the_queue_is_400_not_503(server):
    """1000 prompts (more rows than max_queue ever holds) is the client's mistake, not a moment's load:
    a 400 naming the field, which the openai client does not retry (it retries 503s)."""
    status, headers, text = raw(server, "POST", "/v1/completions", {"prompt": ["a"] * 1000, "max_tokens": 2})
    assert_error(text, 400, status, param="prompt", code="invalid_value")
    assert "Retry-After" not in headers and "1000" in json.loads(text)["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model="tiny", prompt=["a"] * 40, n=2, max_tokens=2)  # 80 rows > 64
    assert e.value.body["param"] == "n"
    assert client(server).completions.create(model="tiny", prompt=["a"] * 8, max_tokens=2).choices
