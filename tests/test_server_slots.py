"""Structured replies run through the one scheduler as tasks (engine/slots.py: generators of jobs, no
thread waiting on the scheduler): concurrent infilled (and grammar-path) requests share batched
forwards and reply exactly what each would alone; a failing job fails alone; a cancelled task or a
stopping server leaves no task pending."""

from __future__ import annotations

import time
import pytest
from helpers import save_tiny_model

import clover
from clover.engine import slots
from clover.server.scheduler import Cancelled, Scheduler
from clover.server.structured import format_plan, infill_format, infill_format_task

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


def _task(model, tok, text, schema, max_tokens=120) -> slots.Task:
    """`_reply` as a task, planned up to its first job (as a request handler does)."""
    ids = tok(text).input_ids
    task = slots.Task(infill_format_task(model, tok, ids, format_plan(
        {"type": "json_schema", "json_schema": {"schema": schema}}), 0.5, 4, max_tokens))
    task.resume()
    return task


def _result(task: slots.Task):
    r = task.future.result(timeout=120)
    return r.content, r.info, r.finish


def _concurrent(model, tok, texts, schema, start_after: int, runner: str = "eager"):
    """Each text a task of one scheduler, which starts once `start_after` tasks are queued (so they
    are admitted together; the others join mid-run)."""
    sched = Scheduler(model, (tok.eos_token_id,), max_batch=8, runner=runner)
    tasks = [_task(model, tok, t, schema) for t in texts]
    sched.submit(tasks[:start_after])
    sched.start()
    for task in tasks[start_after:]:
        sched.submit([task])
    out = [_result(t) for t in tasks]
    sched.stop()
    return out


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
    real = slots.SlotJob.advance

    def flaky(self, logits):
        if logits is not None and getattr(self.task, "poison", False):
            raise RuntimeError("boom")
        return real(self, logits)

    monkeypatch.setattr(slots.SlotJob, "advance", flaky)
    sched = Scheduler(model, (tok.eos_token_id,), max_batch=8)
    results: dict[str, object] = {}
    tasks = {name: _task(model, tok, text, SCHEMA) for name, text in (("good", ASKS[0]), ("bad", ASKS[1]))}
    tasks["bad"].poison = True
    sched.start()
    for task in tasks.values():
        calls["n"] += 1
        sched.submit([task])
    for name, task in tasks.items():
        try:
            results[name] = _result(task)
        except RuntimeError as e:
            results[name] = str(e)
    sched.stop()
    monkeypatch.setattr(slots.SlotJob, "advance", real)
    assert results["bad"] == "boom"
    assert results["good"] == _reply(model, tok, ASKS[0], SCHEMA)
    assert calls["n"] >= 2


def test_a_cancelled_request_leaves_between_steps(loaded):
    """The client of a structured request went away: its running job leaves the scheduler (its task
    ends with Cancelled), the request beside it finishes as it would alone."""
    model, tok = loaded
    sched = Scheduler(model, (tok.eos_token_id,), max_batch=8)
    gone, stays, out = _task(model, tok, ASKS[0], GRAMMAR), _task(model, tok, ASKS[1], GRAMMAR), {}
    sched.start()
    sched.submit([gone, stays])
    deadline = time.time() + 30
    while len(sched.core.jobs) < 2 and time.time() < deadline:
        time.sleep(0.001)
    sched.cancel([gone])
    for name, task in (("gone", gone), ("stays", stays)):
        try:
            out[name] = _result(task)
        except Cancelled as e:
            out[name] = e
    sched.stop()
    assert isinstance(out["gone"], Cancelled)
    assert out["stays"] == _reply(model, tok, ASKS[1], GRAMMAR)
    assert not sched.core.jobs


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


def test_a_stopping_server_leaves_no_task_pending(loaded):
    """Tasks running and tasks still queued when the scheduler stops all end (with an error): none
    is left waiting for an answer."""
    model, tok = loaded
    sched = Scheduler(model, (tok.eos_token_id,), max_batch=8)
    running = [_task(model, tok, a, GRAMMAR, max_tokens=400) for a in ASKS[:2]]
    sched.start()
    sched.submit(running)
    deadline = time.time() + 30
    while len(sched.core.jobs) < 2 and time.time() < deadline:
        time.sleep(0.001)
    with sched.cv:  # queued behind the stop: never admitted
        sched.stopping = True
        queued = _task(model, tok, ASKS[2], GRAMMAR)
        sched.waiting.append(queued)
        sched.cv.notify()
    sched.stop()
    for task in running + [queued]:
        assert task.future.done() and task.future.exception() is not None
    assert not sched.core.jobs and not sched.waiting


def test_a_client_that_goes_away_cancels_its_task_at_once(loaded):
    """Over HTTP: a structured request whose client disconnects mid-decode has its job leave the
    scheduler while the decode still had most of its forwards to go."""
    import http.client
    import json

    from server_utils import RunningServer

    from clover.api import eos_ids
    from clover.server import Settings, create_app

    model, tok = loaded
    app = create_app(model, tok, Settings(model_id="tiny", block_size=4, threshold=0.5), eos_ids(model, tok))
    sched = app.state.scheduler
    forwards = []

    def slow(*_):  # every forward takes a while: the decode would run for seconds
        forwards.append(1)
        time.sleep(0.05)

    hook = model.register_forward_hook(slow)
    body = {"messages": [{"role": "user", "content": "Any text."}], "max_tokens": 400,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "string"}}}}
    try:
        with RunningServer(app) as server:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            deadline = time.time() + 30
            while not sched.core.jobs and time.time() < deadline:
                time.sleep(0.005)
            assert sched.core.jobs  # decoding
            conn.sock.close()  # the client goes away
            while sched.core.jobs and time.time() < deadline:
                time.sleep(0.01)
            assert not sched.core.jobs
            assert len(forwards) < 100  # it stopped long before its 400-token budget
    finally:
        hook.remove()


def test_concurrent_forced_tool_calls_equal_their_solo_replies(loaded):
    """8 forced tool-call requests (tool_choice required, parallel_tool_calls) at once reply what they
    reply one after another, and share forwards (bench/tool_calls.py times it)."""
    from concurrent.futures import ThreadPoolExecutor

    from server_utils import RunningServer, client

    from clover.api import eos_ids
    from clover.server import Settings, create_app

    model, tok = loaded
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["city"]}}} for n in ("weather", "time")]
    asks = [f"Question {i}: the weather in city {i}?" for i in range(8)]
    with RunningServer(create_app(model, tok, Settings(model_id="tiny", block_size=4, threshold=0.5, max_batch=16),
                                  eos_ids(model, tok))) as server:
        c = client(server)

        def call(ask):
            r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ask}], tools=tools,
                                          tool_choice="required", parallel_tool_calls=True, max_tokens=64)
            return [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]

        alone = [call(a) for a in asks]
        with Counted(model) as batched, ThreadPoolExecutor(8) as pool:
            together = list(pool.map(call, asks))
    assert together == alone and all(alone)
    assert max(batched.rows) > 1  # some forward served several requests


def test_a_client_that_goes_away_cancels_its_rows_at_once(loaded):
    """Over HTTP, a completion whose client disconnects while its tokens keep coming (not streamed)
    has its rows leave the engine long before their budget is spent."""
    import http.client
    import json

    from server_utils import RunningServer

    from clover.api import eos_ids
    from clover.server import Settings, create_app

    model, tok = loaded
    app = create_app(model, tok, Settings(model_id="tiny", block_size=4, mode="ar"), eos_ids(model, tok))
    sched, forwards = app.state.scheduler, []

    def slow(*_):
        forwards.append(1)
        time.sleep(0.02)

    hook = model.register_forward_hook(slow)
    body = {"prompt": "Once upon", "max_tokens": 400, "n": 2, "ignore_eos": True}
    try:
        with RunningServer(app) as server:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            deadline = time.time() + 120
            while not any(s.token_ids for e in list(sched.engines.values()) for s in e.seqs) and time.time() < deadline:
                time.sleep(0.005)
            assert sched.running_rows == 2  # decoding
            conn.sock.close()
            deadline = time.time() + 30
            while sched.engines and time.time() < deadline:
                time.sleep(0.01)
            assert not sched.engines and len(forwards) < 200
    finally:
        hook.remove()


def test_a_fresh_job_with_no_partner_sits_out_one_step_once():
    """slots.ready: a job before its first forward, alone in its shape, waits one step while others run
    (never twice, never when nothing else runs); a job that has run, or has partners of its task's phase,
    never waits; fresh partners whose tasks are ahead of a task beside them wait one step."""
    from types import SimpleNamespace

    def job(fresh=True, ordinal=0):
        return SimpleNamespace(fresh=fresh, waited=False, ordinal=ordinal)

    ahead, behind = [job(ordinal=1), job(ordinal=1)], [job(), job()]
    assert slots.ready([ahead, behind]) == [behind] and all(j.waited for j in ahead)
    assert slots.ready([ahead, behind]) == [ahead, behind]  # once only

    late, group = job(), [job(), job()]
    assert slots.ready([[late], group]) == [group] and late.waited
    assert slots.ready([[late], group]) == [[late], group]  # once only
    alone = [[job()], [job()]]
    assert slots.ready(alone) == alone  # nobody else runs: no one waits
    ran = job(fresh=False)
    assert slots.ready([[ran], group]) == [[ran], group]


def test_tasks_a_step_apart_meet_in_phase_and_reply_as_alone(loaded, monkeypatch):
    """Forced tool calls whose tasks start a step apart: the late ones' jobs share forwards with the
    first's once its next job has sat out a step, so fewer forwards than in lockstep a step behind; the
    replies are each task's alone. Jobs of one width only (no `ragged_drafts`): with per-row widths a job a
    step behind shares its forwards anyway, in windows padded to the widest."""
    import torch

    from clover.server.protocol import ToolPlan
    from clover.server.structured import infill_tool_call, infill_tool_call_task

    model, tok = loaded
    monkeypatch.setattr(type(model), "ragged_drafts", False)
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
             for n in ("weather", "time")]
    plan = ToolPlan(tools, [t["function"] for t in tools], "required", True)
    prompts = [tok(f"Question {i}: the weather in city {i}?").input_ids for i in range(4)]
    alone = [infill_tool_call(model, tok, p, plan, 0.5, 4, 64).tool_calls for p in prompts]

    def run() -> tuple[list, int]:
        core, tasks = slots.SlotMode(), [slots.Task(infill_tool_call_task(model, tok, p, plan, 0.5, 4, 64)) for p in prompts]

        def go(task, done=None):
            job = task.resume(done)
            while job is not None:
                core.join(job)
                if not job.finished:
                    return
                job = task.resume(job)

        with torch.inference_mode():  # as the scheduler's loop
            go(tasks[0])
            for i in range(1000):
                for job in core.step():
                    go(job.task, job)
                if i == 0:
                    for task in tasks[1:]:
                        go(task)
                if not core.running:
                    break
        return [t.future.result().tool_calls for t in tasks], core.forwards

    def names(calls):
        return [[c["function"] for c in r] for r in calls]

    replies, forwards = run()
    monkeypatch.setattr(slots, "ready", lambda groups: groups)
    replies_lockstep, forwards_lockstep = run()
    assert names(replies) == names(replies_lockstep) == names(alone)
    assert forwards < forwards_lockstep


def test_fresh_tasks_wait_for_requests_on_their_way(loaded):
    """While a request that may submit a task is on its way (`arriving`), tasks that have not run a forward
    wait for it, at most GATHER_S after the last arrival; a lone request (nothing on its way) never waits."""
    from clover.server import scheduler as sch

    model, tok = loaded
    sched = Scheduler(model, (tok.eos_token_id,), max_batch=8)
    sched.submit([_task(model, tok, ASKS[0], SCHEMA)])
    assert sched._gather_for(time.perf_counter()) == 0  # nothing on its way
    with sched.arriving() as arrival:
        now = time.perf_counter()
        assert 0 < sched._gather_for(now) <= sch.GATHER_S
        assert sched._gather_for(now + sch.GATHER_S) == 0  # the wait is bounded
        sched.submit([_task(model, tok, ASKS[1], SCHEMA)], arrival)
        assert sched.planning == 0 and sched._gather_for(time.perf_counter()) == 0
    assert sched.planning == 0
    with sched.arriving():
        pass  # ended without a task (an error, a plain reply)
    assert sched.planning == 0 and sched._gather_for(time.perf_counter()) == 0


def test_tasks_arriving_in_a_burst_start_in_one_forward(loaded):
    """The scheduler runs while a second request is still on its way: the first task waits for it, so
    their first jobs share one forward, and each replies as it would alone."""
    model, tok = loaded
    alone = [_reply(model, tok, t, SCHEMA) for t in ASKS[:2]]
    sched = Scheduler(model, (tok.eos_token_id,), max_batch=8)
    sched.start()
    tasks = [_task(model, tok, t, SCHEMA) for t in ASKS[:2]]
    with Counted(model) as counted:
        with sched.arriving() as arrival:
            sched.submit([tasks[0]])
            time.sleep(0.005)
            sched.submit([tasks[1]], arrival)
        out = [_result(t) for t in tasks]
    sched.stop()
    assert out == alone
    assert counted.rows[0] == 2
