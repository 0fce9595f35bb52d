"""Structured replies run through the one scheduler: concurrent infilled (and grammar-path) requests
share batched forwards and reply exactly what each would alone; a failing job fails alone."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
from helpers import save_tiny_model

import clover
from clover.engine import slots
from clover.server.scheduler import Plan, Scheduler
from clover.server.structured import format_plan, infill_format

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}, "city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["name", "age", "ok"]}
GRAMMAR = {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "integer"}]}
ASKS = ["Tell me about Ann.", "Bob?", "Who lives in Rome, and how old?", "A person, please: any."]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return clover.load(save_tiny_model(tmp_path_factory.mktemp("slots-model")))


class Counted:
    """Counts the model's forwards and their row counts."""

    def __init__(self, model):
        self.rows: list[int] = []
        self.handle = model.register_forward_hook(lambda m, args, kw, out: self.rows.append(kw["input_ids"].shape[0]
                                                                                           if "input_ids" in kw
                                                                                           else args[0].shape[0]),
                                                  with_kwargs=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _reply(model, tok, text, schema, max_tokens=120):
    ids = tok(text).input_ids
    r = infill_format(model, tok, ids, format_plan({"type": "json_schema", "json_schema": {"schema": schema}}),
                      0.5, 4, max_tokens)
    return r.content, r.info, r.finish


def _concurrent(model, tok, texts, schema, start_after: int, runner: str = "eager"):
    """Each text planned in a thread of its own, its forwards run by one scheduler that starts once
    `start_after` jobs are queued (so they are admitted together; the others join mid-run)."""
    sched = Scheduler(model, (tok.eos_token_id,), max_batch=8, runner=runner)
    out: dict[int, object] = {}

    def plan(i, text):
        with slots.driving(partial(sched.run_job, Plan())):
            out[i] = _reply(model, tok, text, schema)

    threads = [threading.Thread(target=plan, args=(i, t)) for i, t in enumerate(texts)]
    for t in threads[:start_after]:
        t.start()
    deadline = time.time() + 30
    while len(sched.slot_waiting) < start_after and time.time() < deadline:
        time.sleep(0.005)
    sched.start()
    for t in threads[start_after:]:
        t.start()
    for t in threads:
        t.join(timeout=120)
    sched.stop()
    return [out[i] for i in range(len(texts))]


@pytest.mark.parametrize("schema", [SCHEMA, GRAMMAR], ids=["infill", "grammar"])
def test_concurrent_structured_requests_batch_and_equal_their_solo_replies(loaded, schema):
    model, tok = loaded
    with Counted(model) as solo:
        alone = [_reply(model, tok, t, schema) for t in ASKS]
    with Counted(model) as batched:
        together = _concurrent(model, tok, ASKS, schema, start_after=3)
    assert together == alone
    assert alone[0][1]["method"] == ("infill" if schema is SCHEMA else "grammar")
    assert max(batched.rows) > 1  # some forward served several requests
    assert len(batched.rows) < len(solo.rows)  # fewer model calls than the requests made alone
    assert sum(batched.rows) == sum(solo.rows)  # the same rows computed, only batched


def test_a_failing_job_fails_alone(loaded, monkeypatch):
    """A job whose own logic raises gets its error; the jobs beside it finish as they would alone."""
    model, tok = loaded
    calls = {"n": 0}
    real = slots.Job.advance

    def flaky(self, logits):
        if logits is not None and getattr(self, "poison", False):
            raise RuntimeError("boom")
        return real(self, logits)

    monkeypatch.setattr(slots.Job, "advance", flaky)
    sched = Scheduler(model, (tok.eos_token_id,), max_batch=8)
    results: dict[str, object] = {}
    real_run = sched.run_job

    def run_job(job):
        if threading.current_thread().name == "bad":
            job.poison = True
        calls["n"] += 1
        return real_run(Plan(), job)

    def plan(name, text):
        with slots.driving(run_job):
            try:
                results[name] = _reply(model, tok, text, SCHEMA)
            except RuntimeError as e:
                results[name] = str(e)

    threads = [threading.Thread(target=plan, args=(n, t), name=n) for n, t in (("good", ASKS[0]), ("bad", ASKS[1]))]
    sched.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    sched.stop()
    monkeypatch.setattr(slots.Job, "advance", real)
    assert results["bad"] == "boom"
    assert results["good"] == _reply(model, tok, ASKS[0], SCHEMA)
    assert calls["n"] >= 2


def test_a_cancelled_request_leaves_between_steps(loaded):
    """The client of a structured request went away: its running job leaves the scheduler (its worker
    raises Cancelled), the request beside it finishes as it would alone."""
    from clover.server.scheduler import Cancelled

    model, tok = loaded
    sched = Scheduler(model, (tok.eos_token_id,), max_batch=8)
    gone, stays, out = Plan(), Plan(), {}

    def plan(name, p, text):
        with slots.driving(partial(sched.run_job, p)):
            try:
                out[name] = _reply(model, tok, text, GRAMMAR)
            except Cancelled as e:
                out[name] = e

    threads = [threading.Thread(target=plan, args=a) for a in (("gone", gone, ASKS[0]), ("stays", stays, ASKS[1]))]
    sched.start()
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while len(sched.slots.jobs) < 2 and time.time() < deadline:
        time.sleep(0.001)
    sched.cancel_plan(gone)
    for t in threads:
        t.join(timeout=120)
    sched.stop()
    assert isinstance(out["gone"], Cancelled)
    assert out["stays"] == _reply(model, tok, ASKS[1], GRAMMAR)
    assert not sched.plan_of and not sched.slots.jobs


def test_over_http_concurrent_structured_replies_and_free_streams_equal_solo(loaded):
    """Through the routes: structured requests sent at once (beside free completions) reply what
    they reply one after another, and the free completions equal their solo runs."""
    from concurrent.futures import ThreadPoolExecutor

    from server_utils import RunningServer, client

    from clover.api import eos_ids
    from clover.server import Settings, create_app

    model, tok = loaded
    settings = Settings(model_id="tiny", block_size=4, threshold=0.5, max_batch=16, max_queue=64)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    with RunningServer(create_app(model, tok, settings, eos_ids(model, tok))) as server:
        c = client(server)

        def structured(ask):
            r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ask}],
                                          response_format=fmt, max_tokens=120)
            return r.choices[0].message.content, r.model_extra["clover"]["structured"][0]

        def free(prompt):
            return c.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                        extra_body={"ignore_eos": True}).choices[0].text

        alone = [structured(a) for a in ASKS]
        free_alone = [free(a) for a in ASKS]
        with ThreadPoolExecutor(8) as pool:
            frees = [pool.submit(free, a) for a in ASKS]
            together = list(pool.map(structured, ASKS))
            free_together = [f.result() for f in frees]
    assert together == alone and free_together == free_alone
    assert all(info["method"] == "infill" and info["valid"] for _, info in together)
