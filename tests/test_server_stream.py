"""The server's streaming hand-off pieces, without a model: the scheduler's posts held for one
turn and delivered with one wake-up of the event loop, a request's next event, the compiled
runner's forward counts in /metrics, and small prompts encoded on the event loop."""

import asyncio
import threading
import time

import torch

from clover.server import routes
from clover.server.metrics import Metrics
from clover.server.scheduler import Ticket, held_posts


class RecordingLoop:
    """Stands in for an event loop: records call_soon_threadsafe calls and runs them when asked."""

    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, fn, *args):
        self.calls.append((fn, args))

    def run(self):
        calls, self.calls = self.calls, []
        for fn, args in calls:
            fn(*args)


def _ticket(loop):
    t = Ticket.__new__(Ticket)  # no running loop needed: a plain queue stands in
    t.loop, t.queue = loop, asyncio.Queue()
    return t


def _drain(q):
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_posts_in_a_turn_reach_each_loop_at_once_in_order():
    a, b = RecordingLoop(), RecordingLoop()
    t1, t2, t3 = _ticket(a), _ticket(a), _ticket(b)
    with held_posts():
        t1.post("x1")
        t2.post("y1")
        t1.post("x2")
        t3.post("z1")
        assert not a.calls and not b.calls  # nothing leaves before the turn ends
    assert len(a.calls) == 1 and len(b.calls) == 1  # one wake-up per event loop
    a.run()
    b.run()
    assert _drain(t1.queue) == ["x1", "x2"] and _drain(t2.queue) == ["y1"] and _drain(t3.queue) == ["z1"]
    t1.post("x3")  # outside a turn: at once
    assert len(a.calls) == 1
    a.run()
    assert _drain(t1.queue) == ["x3"]


def test_held_posts_go_out_even_when_the_turn_raises():
    loop = RecordingLoop()
    t = _ticket(loop)
    try:
        with held_posts():
            t.post("before")
            raise RuntimeError("step failed")
    except RuntimeError:
        pass
    loop.run()
    assert _drain(t.queue) == ["before"]
    t.post("after")  # the block is closed: no post is held any more
    loop.run()
    assert _drain(t.queue) == ["after"]


def test_posts_are_held_only_in_the_thread_of_the_turn():
    loop = RecordingLoop()
    t = _ticket(loop)
    with held_posts():
        th = threading.Thread(target=t.post, args=("other thread",))
        th.start()
        th.join()
        assert len(loop.calls) == 1  # another thread's post is not held by this turn
        t.post("mine")
        assert len(loop.calls) == 1
        loop.run()
        assert _drain(t.queue) == ["other thread"]  # "mine" waits for the end of the turn
    assert len(loop.calls) == 1
    loop.run()
    assert _drain(t.queue) == ["mine"]


def test_posts_join_a_wake_up_the_loop_has_not_run_yet():
    loop = RecordingLoop()
    t1, t2 = _ticket(loop), _ticket(loop)
    for turn in range(3):  # the loop lags: three turns, one wake-up
        with held_posts():
            t1.post(f"a{turn}")
            t2.post(f"b{turn}")
    assert len(loop.calls) == 1
    loop.run()
    assert _drain(t1.queue) == ["a0", "a1", "a2"] and _drain(t2.queue) == ["b0", "b1", "b2"]
    t1.post("a3")  # the wake-up ran: the next post wakes the loop again
    assert len(loop.calls) == 1
    loop.run()
    assert _drain(t1.queue) == ["a3"]


def test_a_gone_loop_drops_the_posts_quietly():
    class Closed:
        def call_soon_threadsafe(self, *a):
            raise RuntimeError("Event loop is closed")

    with held_posts():
        _ticket(Closed()).post("lost")


def test_a_request_looks_for_its_client_at_every_tick_also_while_events_keep_coming(monkeypatch):
    """No events: the client is looked for every POLL_S and the request ends (jobs cancelled) once it
    is gone. Events every millisecond for longer than that: still looked for (the tick queues behind
    them); the timer is gone when the request ends."""
    from types import SimpleNamespace

    from clover.server.choice import Choice
    from clover.server.scheduler import Tokens

    monkeypatch.setattr(routes, "POLL_S", 0.01)

    async def go(events: bool):
        looked, cancels = [], []
        fake = SimpleNamespace(scheduler=SimpleNamespace(cancel=lambda jobs, reason="cancelled": cancels.append(jobs)))

        async def is_disconnected():
            looked.append(time.monotonic())
            return len(looked) >= 3

        ticket, loop = _ticket(None), asyncio.get_running_loop()
        for k in range(200 if events else 0):  # a long reply: an event every millisecond
            loop.call_later(k / 1000, ticket.queue.put_nowait, Tokens("tokens", 0, [1] * (k + 1), [1], [k], None, {}))
        choices = [Choice(LetterTokenizer(), [], False)]
        t0 = time.monotonic()
        async for _ in routes.Routes.drive(fake, SimpleNamespace(is_disconnected=is_disconnected), ticket, ["job"], choices):
            pass
        await asyncio.sleep(0.03)  # a tick still armed would queue a None by now
        left = [x for x in _drain(ticket.queue) if x is None]
        return len(looked), time.monotonic() - t0, cancels, left

    for events in (False, True):
        looked, took, cancels, left = asyncio.run(go(events))
        assert looked == 3 and cancels == [["job"]] and left == []
        assert 0.025 < took < 0.15


class FakeRunner:
    def __init__(self):
        self.compiled_calls = self.eager_calls = 0


def test_metrics_count_a_compiled_runners_forwards_once():
    m = Metrics()
    r1, r2 = FakeRunner(), FakeRunner()
    r1.compiled_calls, r1.eager_calls = 5, 2
    m.count_runner(r1)
    m.count_runner(r1)  # nothing new since: counted once
    r1.compiled_calls += 3
    m.count_runner(r1)
    r2.eager_calls = 4
    m.count_runner(r2)
    m.count_runner(object())  # an eager runner: not counted
    assert (m.graph_forwards, m.eager_forwards) == (8, 6)
    text = m.render()
    assert "clover_graph_forwards_total 8" in text and "clover_eager_forwards_total 6" in text


class FakeRequest:
    def __init__(self, size):
        self.headers = {} if size is None else {"content-length": str(size)}


def test_small_bodies_encode_on_the_loop_large_ones_in_the_encoder_thread():
    from concurrent.futures import ThreadPoolExecutor

    r = routes.Routes.__new__(routes.Routes)
    r.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clover-encode")
    where = lambda: threading.current_thread().name  # noqa: E731

    async def go():
        return [await r.encode_off_loop(FakeRequest(n), where) for n in (10, routes.INLINE_BODY_BYTES,
                                                                          routes.INLINE_BODY_BYTES + 1, None)]

    try:
        small, edge, large, unknown = asyncio.run(go())
    finally:
        r.encoder.shutdown()
    assert small == edge == threading.current_thread().name
    assert large.startswith("clover-encode") and unknown.startswith("clover-encode")


def _chunk_reference(reply, i, delta=None, text="", finish=None, clover=None) -> str:
    """The chunk as the whole body serialised at once (what `Reply.chunk` must write, byte for byte)."""
    from clover.server.shapes import sse

    choice = {"index": i, "delta": delta or {}} if reply.chat else {"index": i, "text": text}
    choice |= {"logprobs": None, "finish_reason": finish}
    body = reply._head(reply.chunk_object) | {"choices": [choice]}
    if reply.include_usage:
        body["usage"] = None
    if clover is not None:
        body["clover"] = clover
    return sse(body, ensure_ascii=False)


def test_reply_chunks_are_the_bytes_of_the_whole_body_serialised():
    import random

    from clover.server.shapes import Reply

    rng = random.Random(0)
    alphabet = ['a', ' ', '"', '\\', '\n', 'é', '中', '😀', '\x00', '</s>', '{', '}']
    texts = ["", *("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(40))]
    for model_id in ("bench", 'odd "name" ü'):
        for chat in (False, True):
            for include_usage in (False, True):
                reply = Reply(model_id, chat, include_usage)
                for _ in range(30):
                    text = rng.choice(texts)
                    delta = rng.choice([None, {}, {"content": text}, {"reasoning_content": text, "content": ""},
                                        {"role": "assistant", "content": ""}])
                    clover = rng.choice([None, {}, {"committed": [[text, 3]]}, {"tokens": 4, "tpf": 1.5}])
                    args = (rng.randint(0, 3), delta, text, rng.choice([None, "stop", "length"]), clover)
                    assert reply.chunk(*args) == _chunk_reference(reply, *args)


def test_create_app_runs_prepare_unless_the_caller_did(monkeypatch):
    from clover.server import Settings, create_app
    from clover.utils import startup
    from helpers import tiny_model, tiny_tokenizer

    calls, tokenizer = [], tiny_tokenizer()
    monkeypatch.setattr(startup, "prepare", calls.append)
    model = tiny_model(3)
    create_app(model, tokenizer, Settings(model_id="tiny", block_size=4), prepared=True)
    assert calls == []
    create_app(model, tokenizer, Settings(model_id="tiny", block_size=4))
    assert calls == [model]


def test_response_ids_are_24_hex_digits_and_distinct():
    import re

    from clover.server.protocol import new_id

    ids = [new_id("cmpl") for _ in range(1000)]
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == len(ids)


def test_the_served_socket_turns_nagle_off_on_every_connection():
    """`clover serve`'s listening socket says it is TCP, so asyncio sets TCP_NODELAY on each connection it
    accepts: a streamed chunk leaves when it is written, not after the client's delayed ACK of the one before
    (which a kept-alive connection's second stream would wait for)."""
    import socket

    from clover.cli.serve import bind

    sock, seen = bind("127.0.0.1", 0), []

    async def main():
        async def handle(reader, writer):
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        await reader.read()
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert sock.proto == socket.IPPROTO_TCP
    assert seen and seen[0] != 0


def test_a_real_loop_is_woken_through_its_pipe_in_order():
    """A ticket made in its loop's thread sets up the loop's wake-up pipe; a turn's posts from the decoding
    thread arrive whole and in order, and a loop first met from another thread is woken without one."""
    from clover.server.scheduler import Inbox

    async def go():
        loop = asyncio.get_running_loop()
        t1, t2 = Ticket(loop), Ticket(loop)
        assert Inbox.of(loop).pipe is not None

        def turns():
            for turn in range(50):
                with held_posts():
                    t1.post(("a", turn))
                    t2.post(("b", turn))

        th = threading.Thread(target=turns)
        th.start()
        got1 = [await asyncio.wait_for(t1.queue.get(), 10) for _ in range(50)]
        got2 = [await asyncio.wait_for(t2.queue.get(), 10) for _ in range(50)]
        th.join()
        return got1, got2

    got1, got2 = asyncio.run(go())
    assert got1 == [("a", i) for i in range(50)] and got2 == [("b", i) for i in range(50)]

    async def elsewhere():
        loop = asyncio.get_running_loop()
        box = []
        th = threading.Thread(target=lambda: box.append(Inbox.of(loop)))
        th.start()
        th.join()
        t = _ticket(loop)
        threading.Thread(target=t.post, args=("x",)).start()
        return box[0].pipe, await asyncio.wait_for(t.queue.get(), 10)

    assert asyncio.run(elsewhere()) == (None, "x")


def test_deferred_posts_go_right_before_the_next_graph_call_or_the_next_turn():
    from clover.compile.state import state_of
    from clover.server.scheduler import flush_posts

    model = torch.nn.Linear(1, 1)  # any module: the hook is kept by its compile state
    run_before_graph = state_of(model).run_before_graph
    loop = RecordingLoop()
    t = _ticket(loop)
    with held_posts(defer=model):
        t.post("a")
    assert not loop.calls  # held for the next graph call
    run_before_graph()  # the next turn's forward starts its graph
    assert len(loop.calls) == 1
    loop.run()
    assert _drain(t.queue) == ["a"]
    run_before_graph()  # once
    assert not loop.calls
    with held_posts(defer=model):
        t.post("b")
    with held_posts(defer=model):  # a turn without a graph call: "b" goes at its end, before its own posts
        t.post("c")
        assert not loop.calls
    loop.run()
    assert _drain(t.queue) == ["b"]
    flush_posts()  # idle: no graph call is coming
    loop.run()
    assert _drain(t.queue) == ["c"]
    flush_posts()
    run_before_graph()
    assert not loop.calls


class LetterTokenizer:
    """Token i decodes to the i-th lowercase letter (not a byte-level tokenizer: whole decodes)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def _drive(events, stops, merge):
    """(Deltas and Finished as tuples, choices' (content, finish_reason), cancels) of `Routes.drive`
    over `events` all queued before it runs (the event loop behind the decoding)."""
    from types import SimpleNamespace

    from clover.server.choice import Choice
    from clover.server.scheduler import Tokens

    cancels = []
    fake = SimpleNamespace(scheduler=SimpleNamespace(cancel=lambda jobs, reason="cancelled": cancels.append(reason)))
    request = SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, False))

    async def go():
        ticket = _ticket(None)
        ids = {}
        for index, new, finish in events:
            ids[index] = ids.get(index, []) + new
            ticket.queue.put_nowait(Tokens("tokens", index, list(ids[index]), new, [len(ids[index])] * len(new), finish, {}))
        choices = [Choice(LetterTokenizer(), stops, False) for _ in ids]
        out = []
        async for ev in routes.Routes.drive(fake, request, ticket, ["job0", "job1"], choices, merge=merge):
            out.append((ev.index, ev.content, ev.new_tokens, ev.steps) if isinstance(ev, routes.Delta) else ev.index)
        return out, [(c.content, c.finish_reason) for c in choices], cancels

    return asyncio.run(go())


def test_queued_tokens_of_a_choice_give_one_delta_and_the_same_reply():
    events = [(0, [0], None), (0, [1, 2], None), (0, [3], None), (1, [4], None), (0, [5], None), (1, [6], "length"),
              (0, [7], "length")]
    merged, merged_choices, _ = _drive(events, [], merge=True)
    alone, alone_choices, _ = _drive(events, [], merge=False)
    assert merged_choices == alone_choices == [("abcdfh", "length"), ("eg", "length")]
    assert merged == [(0, "abcd", [0, 1, 2, 3], [1, 3, 3, 4]), (1, "e", [4], [1]), (0, "f", [5], [5]),
                      (1, "g", [6], [2]), 1, (0, "h", [7], [6]), 0]
    assert len(alone) == len(events) + 2
    for index in (0, 1):  # the chunks of a choice, put together, are the same text
        text = lambda out: "".join(e[1] for e in out if isinstance(e, tuple) and e[0] == index)  # noqa: E731
        assert text(merged) == text(alone)


def test_merged_tokens_stop_where_the_first_alone_would():
    """Stops "d" and "bcdx": one at a time, "abcd" ends at "d" (content "abc") before "x" comes; the
    whole text "abcdx" at once would end at "bcdx" (content "a")."""
    events = [(0, [0], None), (0, [1], None), (0, [2], None), (0, [3], None), (0, [23], None), (0, [4], "length")]
    merged, merged_choices, merged_cancels = _drive(events, ["d", "bcdx"], merge=True)
    alone, alone_choices, alone_cancels = _drive(events, ["d", "bcdx"], merge=False)
    assert merged_choices[0] == alone_choices[0] == ("abc", "stop")
    assert merged_cancels == alone_cancels == ["stop"]
    assert "".join(e[1] for e in merged if isinstance(e, tuple)) == "".join(e[1] for e in alone if isinstance(e, tuple))
    assert merged[-1] == 0 and len(merged) < len(alone)


def _tokens(index, so_far, new, finish=None):
    from clover.server.scheduler import Tokens

    return Tokens("tokens", index, list(range(so_far + new)), list(range(so_far, so_far + new)), [0] * new, finish, {})


def test_paced_posts_reach_each_request_in_order_with_nothing_lost_as_unpaced_ones():
    """Random turns of random rows (first tokens, next tokens, finish, errors) at random times: a pacer
    of any interval hands each ticket the same posts in the same order as posting every turn (interval
    0, the reference), and holds nothing past a turn at least `interval` after the last hand-over or a
    turn with a post that is not a running row's next tokens."""
    import random

    from clover.server.scheduler import Failed, Pacer

    rng = random.Random(0)
    for trial in range(40):
        interval = rng.choice([0.0, 0.002, 0.004, 0.05])
        loops = [RecordingLoop(), RecordingLoop()]
        pacer, ref = Pacer(interval), Pacer(0.0)
        tickets = [(_ticket(loops[i % 2]), _ticket(loops[i % 2])) for i in range(rng.randint(1, 5))]
        made = [0] * len(tickets)
        now = 0.0
        for turn in range(rng.randint(1, 30)):
            now += rng.choice([0.0005, 0.001, 0.003, 0.01])
            posts = []
            for r, (t, t_ref) in enumerate(tickets):
                if rng.random() < 0.7:
                    n = rng.randint(1, 3)
                    finish = "length" if rng.random() < 0.1 else None
                    item = _tokens(0, made[r], n, finish) if rng.random() < 0.97 else Failed("error", 0, "boom")
                    made[r] += n
                    posts.append(((t, t_ref), item))
            urgent = any(item.kind != "tokens" or item.finish_reason or item.new_tokens[0] == 0 for _, item in posts)
            due = now - pacer.last >= interval
            for ticket, item in pacer.take([(tt[0], item) for tt, item in posts], now):
                ticket.queue.put_nowait(item)
            if urgent or due:
                assert not pacer.held  # nothing waits past a due turn or one with a first / last / error post
            out = ref.take([(tt[1], item) for tt, item in posts], now)
            assert [i for _, i in out] == [i for _, i in posts]  # interval 0 holds nothing
            for ticket, item in out:
                ticket.queue.put_nowait(item)
        for ticket, item in pacer.release():
            ticket.queue.put_nowait(item)
        for t, t_ref in tickets:
            assert _drain(t.queue) == _drain(t_ref.queue)


def test_a_paced_row_first_and_last_tokens_go_at_once_taking_the_held_ones():
    from clover.server.scheduler import Pacer

    loop = RecordingLoop()
    t = _ticket(loop)
    pacer = Pacer(0.004)
    with held_posts(pacer=pacer):
        t.post(_tokens(0, 0, 1))  # the first tokens: at once
    assert len(loop.calls) == 1
    loop.run()
    assert [e.new_tokens for e in _drain(t.queue)] == [[0]]
    for k in range(1, 3):  # within the interval: held
        with held_posts(pacer=pacer):
            t.post(_tokens(0, k, 1))
    assert not loop.calls and len(pacer.held) == 2
    with held_posts(pacer=pacer):  # the last tokens take the held ones with them, in order
        t.post(_tokens(0, 3, 1, "length"))
    loop.run()
    assert [e.new_tokens for e in _drain(t.queue)] == [[1], [2], [3]] and not pacer.held
    pacer.last = time.perf_counter() - 0.005  # the interval has passed: the next tokens go at once
    with held_posts(pacer=pacer):
        t.post(_tokens(0, 4, 1))
    loop.run()
    assert [e.new_tokens for e in _drain(t.queue)] == [[4]]


def test_tokens_held_by_the_pacer_go_out_before_a_graph_load_between_turns():
    """A graph loaded between turns takes milliseconds: the posts of the turns before it, those the
    pacer holds for its interval too, are handed to their request's loop before the load starts."""
    from clover.engine import DecodeConfig
    from clover.server.scheduler import RowJob, Scheduler
    from helpers import tiny_model, tiny_tokenizer

    class Loads:  # stands in for the compiling child: a graph to load after every turn
        def sync(self):
            pass

        def waiting(self):
            return 0

        def can_load(self):
            return True

        def pace(self, decoding):
            pass

        def close(self):
            pass

    model, tokenizer = tiny_model(3), tiny_tokenizer()
    key, ids = DecodeConfig(mode="ar", block_size=1).engine_key(), tokenizer("hello")["input_ids"]
    loop = RecordingLoop()
    ticket = _ticket(loop)
    sched = Scheduler(model, (), max_batch=4, stream_interval=60.0)  # held until a last post or a flush
    sched.compiles = Loads()
    undelivered_at_load = []
    sched._compile_one = lambda traced: undelivered_at_load.append(len(sched.pacer.held))
    sched.start()
    try:
        sched.submit([RowJob(ticket, 0, ids, 6, key)])
        deadline, events = time.time() + 60, []
        while not (events and events[-1].finish_reason) and time.time() < deadline:
            loop.run()
            events += _drain(ticket.queue)
            time.sleep(0.01)
    finally:
        sched.stop()
    assert events[-1].finish_reason and sum(len(e.new_tokens) for e in events) == 6
    assert len(undelivered_at_load) >= 4 and set(undelivered_at_load) == {0}
