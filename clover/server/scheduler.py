"""One background thread runs every decoding: continuous batching over the engine.

* A request becomes one `RowJob` per choice (row). Jobs wait in a bounded FIFO (`max_queue` rows;
  a full queue is refused up front, the HTTP layer answers 503 + Retry-After).
* Jobs are grouped by engine key (`DecodeConfig.engine_key`: all the decoding settings but the budget): rows
  that decode the same way share one `Engine`, so one batched forward serves them all. Each row
  has its own token budget (`Engine.add(..., max_new_tokens=[...])`).
* Loop: apply cancellations -> admit waiting jobs while fewer than `max_batch` rows run (each
  admitted group is prefilled as one batch and joins its engine's running rows; its first block
  starts there; a prompt of more than one prefill chunk prefills one chunk per step of its engine,
  after the running rows' forward, so a long prompt stalls nobody for longer than a chunk:
  `Engine.add(interleave=True)`) -> one `step()` of every engine -> hand committed blocks to their
  jobs. A row leaves its engine when it finishes (EOS, budget) or is cancelled (client gone, stop
  string): its cache rows are freed at once (`Engine.finish`), and an engine with no rows is dropped.
* Structured replies (response_format, forced tool calls) and /v1/decide are tasks (engine/slots.py:
  a generator of slot jobs, CPU planning in between): the request plans up to its first job off the
  event loop and submits the task; this thread runs its jobs beside the engines, one forward per job
  per loop turn, jobs of the same shape batched in one forward (a job just started with no partner
  sits out one turn, so requests that arrived a turn apart get in phase: slots.ready), and resumes the
  task with each job's result. No thread waits on another. A task's failure is its own (its future holds the error); a
  cancelled task's job leaves between steps and the task ends with `Cancelled`.
* `--runner compiled`: the engines and the slot jobs defer compiling (a step of a shape with no graph
  runs eagerly and queues the shape); the queued shapes are compiled in a child process into the
  on-disk caches (`compile.warm.Background`; while it has shapes queued, stopped while rows decode
  but for a share of the time, `Background.pace`), which reports the cache key of each graph it finished;
  the loop loads such a graph by its key between turns (no trace: milliseconds, `compile.stored`),
  so no request waits on a compile. A graph the child could not give a key for is compiled here
  (a trace and a cache hit, seconds) only after IDLE_BEFORE_COMPILE_S without work; a request that
  arrives during that waits for it. A restarted server loads the graphs an earlier server's child
  noted on disk by their keys at start-up, before it answers.
* Results cross to the asyncio side on the tickets' queues: the posts of one loop turn go together,
  one wake-up of the event loop per turn (`held_posts`), so the event loop's thread takes the GIL
  once per step instead of once per row; while that wake-up is still pending (the event loop lags
  behind) later turns' posts join it instead of waking the loop again (`Inbox`). With
  `--runner compiled` a turn's posts go right before the next turn's first graph call, so the loop's
  thread runs beside that graph (`held_posts(defer=model)`).
* Failures stay with the request that caused them. Admission: a group whose engine cannot be built
  or whose prefill raises is retried job by job, so only the jobs that fail alone get an error. Step:
  a batched `step()` that raises does not say which row caused it. Rows that joined since the
  engine's last good step are the suspects: each goes on in an engine of its own ("solo"), the others
  are rebuilt as one batch. Without suspects (or with only suspects) every row goes solo. A moved row
  is re-prefilled from its prompt + committed tokens; an engine of one row that raises ends that row
  with an error. Greedy rows go on with the same tokens (the block in progress restarts from its
  masks); a sampled row restarts its generator from the request's seed. A solo row never rejoins a batch.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
import traceback
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch

from ..compile.warm import Background
from ..engine import DEFAULTS, DecodeConfig, Engine, Sequence
from ..engine.runner import before_next_graph
from ..engine.slots import SlotJob
from ..engine.slots import SlotMode, Task
from .metrics import Metrics

COMPILE_POLL_S = 0.2  # idle with shapes in the compiling child: how often the loop looks for a finished one
IDLE_BEFORE_COMPILE_S = 2.0  # how long the loop must have had nothing to do before it loads a graph
STREAM_INTERVAL_S = 0.008  # the default longest wait of a running row's next tokens (`Pacer`; `clover serve --stream-interval-ms`)
GATHER_S = 0.03  # fresh tasks wait for tasks still being planned at most this long after the last arrival


# ---- what the scheduler posts to a request (typed; tuples underneath, so `event[0]` is the kind) ----
class Tokens(NamedTuple):
    """Choice `index` committed `new_tokens` (filled at `steps`); `token_ids` is all it has so far."""

    kind: Literal["tokens"]
    index: int
    token_ids: list[int]
    new_tokens: list[int]
    steps: list[int]
    finish_reason: str | None
    stats: dict


class Live(NamedTuple):
    """The block choice `index` is denoising, as (token or None, fill step) pairs (the playground)."""

    kind: Literal["live"]
    index: int
    view: list
    stats: dict


class Failed(NamedTuple):
    kind: Literal["error"]
    index: int
    message: str


Event = Tokens | Live | Failed


class QueueFull(Exception):
    pass


class Cancelled(Exception):
    """The error a task ends with when its client went away (or the server stops)."""


class Ticket:
    """One HTTP request's mailbox: the scheduler thread posts, the request's coroutine reads. Inside
    `held_posts` a post waits for the end of that block, where every held post goes out together.
    Made in the event loop's thread (its loop's `Inbox` is set up there)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        Inbox.of(loop)

    def post(self, item: Event) -> None:
        held = getattr(_held, "posts", None)
        if held is not None:
            held.append((self, item))
        else:
            deliver([(self, item)])


_held = threading.local()  # `posts`: the posts held by this thread's open `held_posts` block


@contextmanager
def held_posts(defer=None, pacer: "Pacer | None" = None):
    """Posts made in the block reach their requests at its end, one wake-up of each event loop for
    all of them (a scheduler turn: one hand-off to the event loop's thread per step, not one per
    row), in the order they were made. `defer` (a model): they go instead right before this thread's
    next compiled graph call of that model (`runner.before_next_graph`), where it lets go of the GIL
    for the graph's run, so the woken loop's thread runs beside the graph rather than taking the GIL
    at the first short op before it (every torch op lets go of the GIL) while this thread waits;
    posts no graph call took by the end of the next block go there (first), or at `flush_posts`.
    `pacer`: the block's posts go through it (it may hold them for a later block)."""
    _held.posts = []
    try:
        yield
    finally:
        posts, _held.posts = _held.posts, None
        flush_posts()
        if pacer is not None:
            posts = pacer.take(posts, time.perf_counter())
        if defer is not None and posts:
            _held.deferred = posts
            before_next_graph(defer, flush_posts)
        else:
            deliver(posts)


class Pacer:
    """Running rows' token posts between scheduler turns: held, in order, until `interval` seconds have
    passed since the last hand-over, then all of them go (the event loop joins a choice's queued tokens
    into one chunk: one wake-up of the loop's thread, and one chunk for the client to read, per interval
    instead of per step, while the decoding thread runs its graphs). A post that is not a running row's
    next tokens - a row's first tokens (time to first token), its last ones (finish), an error, the
    playground's view - takes every held post with it at once, so no request waits on the interval to
    start or to end. `interval` 0: every turn's posts go at its end."""

    def __init__(self, interval: float = 0.0):
        self.interval, self.held, self.last = interval, [], float("-inf")

    def take(self, posts: list, now: float) -> list:
        """The posts to hand over at `now`: those held before, then `posts`; none while they may wait."""
        posts = self.held + posts if self.held else posts
        if posts and now - self.last < self.interval and not any(_urgent(item) for _, item in posts):
            self.held = posts
            return []
        self.held = []
        if posts:
            self.last = now
        return posts

    def release(self) -> list:
        """Every held post (the loop goes idle, or fails the turn's rows)."""
        posts, self.held = self.held, []
        return posts


def _urgent(item: Event) -> bool:
    return item.kind != "tokens" or item.finish_reason is not None or len(item.token_ids) == len(item.new_tokens)


def flush_posts() -> None:
    """The posts a `held_posts(defer=model)` block of this thread left for a graph call, now."""
    posts = getattr(_held, "deferred", None)
    if posts:
        _held.deferred = None
        deliver(posts)


def deliver(posts: list[tuple[Ticket, Event]]) -> None:
    """Posts to their tickets' queues, through each event loop's `Inbox`: at most one wake-up of a
    loop pending at a time."""
    by_loop: dict = {}
    for ticket, item in posts:
        by_loop.setdefault(ticket.loop, []).append((ticket.queue, item))
    for loop, items in by_loop.items():
        Inbox.of(loop).add(loop, items)


def _holding_write():
    """libc's write(2) called with the GIL held (ctypes.PyDLL), or None where there is none."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return None
    write.argtypes, write.restype = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t), ctypes.c_ssize_t
    return write


_WRITE = _holding_write()


class Inbox:
    """The posts on their way to one event loop. A post finds the loop's wake-up already pending while
    the loop has not run it yet, and just joins it: a loop that lags behind the decoding takes several
    turns' posts in one wake-up.

    The wake-up is a byte on a pipe the loop reads (`add_reader`), written with the GIL held: the
    decoding thread keeps the GIL until its next forward lets go of it, so the loop's thread, woken,
    runs while the forward does instead of taking the GIL from the decoding thread mid-turn (which a
    write that releases the GIL, as `call_soon_threadsafe`'s, lets it do). Where the loop has no
    `add_reader` (or there is no libc write): `call_soon_threadsafe`."""

    _all: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _made = threading.Lock()

    def __init__(self, loop=None):
        self.lock, self.items, self.pending = threading.Lock(), [], False
        self.pipe = self._open(loop) if loop is not None and _WRITE is not None else None

    def _open(self, loop):
        """The wake-up pipe (read end, write end), or None; only in the loop's own thread (`add_reader`
        is not thread-safe): a loop first met elsewhere wakes by `call_soon_threadsafe`."""
        try:
            if asyncio.get_running_loop() is not loop:
                return None
            r, w = os.pipe()
        except (OSError, RuntimeError):
            return None
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            loop.add_reader(r, self._woken, r)
        except (NotImplementedError, AttributeError, RuntimeError):
            os.close(r)
            os.close(w)
            return None
        weakref.finalize(self, _close, r, w)
        return r, w

    @classmethod
    def of(cls, loop) -> Inbox:
        """The loop's inbox (a fresh one, not shared, for a loop that takes no weak reference)."""
        with cls._made:
            try:
                box = cls._all.get(loop)
                if box is None:
                    box = cls._all[loop] = cls(loop)
            except TypeError:
                box = cls()
            return box

    def add(self, loop, items: list) -> None:
        with self.lock:
            self.items += items
            if self.pending:
                return
            self.pending = True
        if self.pipe is not None and not loop.is_closed():
            _WRITE(self.pipe[1], b"\0", 1)  # a full pipe (-1): a wake-up is pending anyway
            return
        try:
            loop.call_soon_threadsafe(self.drain)
        except RuntimeError:  # the loop is gone (server shutting down)
            with self.lock:
                self.items, self.pending = [], False

    def _woken(self, r: int) -> None:
        try:
            os.read(r, 4096)
        except OSError:
            pass
        self.drain()

    def drain(self) -> None:
        """(In the loop's thread) everything posted so far, into the tickets' queues, in order."""
        with self.lock:
            items, self.items, self.pending = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


@dataclass(eq=False)
class RowJob:
    """One choice (row) of a completion request, decoded by the engine of its key (a `SlotJob`,
    engine/slots.py, is instead one step generator of a structured task)."""

    ticket: Ticket
    index: int  # choice index within the request
    prompt_ids: list[int]
    max_new_tokens: int
    key: DecodeConfig  # its engine's key (DecodeConfig.engine_key)
    live: bool = False  # post the current block's view after every step (the playground)
    arrived: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None
    state: str = "waiting"  # waiting -> running -> done
    first_block: bool = False
    place: object = None  # where it runs: its engine's key in Scheduler.engines: the engine key, or (key, id) when solo
    proven: bool = False  # has taken part in a step of its current engine that did not raise


class Scheduler:
    def __init__(self, model, eos_token_ids: tuple[int, ...], max_batch: int = 32, max_queue: int = 256,
                 metrics: Metrics | None = None, runner: str = DEFAULTS.runner, stream_interval: float = 0.0):
        """`stream_interval`: seconds a running row's next tokens may wait to be posted, joined (`Pacer`)."""
        self.model, self.eos, self.runner = model, tuple(eos_token_ids), runner
        self.pacer = Pacer(stream_interval)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.metrics = metrics or Metrics()
        self.cv = threading.Condition()
        self.waiting: deque[RowJob | Task] = deque()  # rows of requests, and tasks, in order of arrival
        self.to_cancel: list[tuple[RowJob | Task, str]] = []
        self.engines: dict[object, Engine] = {}  # engine key: shared engine; (key, id(job)): solo
        self.jobs: dict[int, RowJob] = {}  # id(seq) -> job, for running rows
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.compiling = False  # in `_compile_one` (nothing decoding)
        self.idle_since = 0.0  # when the loop last had work (time.perf_counter)
        self.planning, self.arrival = 0, 0.0  # requests on their way to a task (`arriving`); the last arrival's time
        self.core = SlotMode(runner, defer=True)  # the running jobs of tasks (infill, grammar, decide)
        self.compiles: Background | None = None  # --runner compiled: made by `start` (it forks a child)

    # ---- called from request handlers ----------------------------------------------------------
    def config(self, key: DecodeConfig, max_new_tokens: int = 1) -> DecodeConfig:
        """The engine config for a key (`DecodeConfig.engine_key`): this server's EOS ids and runner;
        raises ValueError (-> 400) for settings the model can't run."""
        return key.with_(max_new_tokens=max_new_tokens, eos_token_ids=self.eos, runner=self.runner).check(self.model)

    @contextmanager
    def arriving(self):
        """A request that may submit a task, from its arrival until it submits one (`submit(..., arrival)`)
        or ends: while any is on its way, tasks that have not run a forward wait for it (`_gather`)."""
        arrival = [True]  # on its way
        with self.cv:
            self.planning += 1
            self.arrival = time.perf_counter()
        try:
            yield arrival
        finally:
            with self.cv:
                self._arrived(arrival)

    def _arrived(self, arrival: list | None) -> None:
        """(Under the lock) `arrival` is no longer on its way."""
        if arrival and arrival[0]:
            arrival[0], self.planning, self.arrival = False, self.planning - 1, time.perf_counter()
            self.cv.notify()

    def submit(self, items: list[RowJob | Task], arrival: list | None = None) -> None:
        """Queue a request's rows (a full queue refuses them: QueueFull), or a task (its first job
        planned: `Task.resume`; `arrival`: the request's `arriving`, which this ends)."""
        rows = sum(isinstance(i, RowJob) for i in items)
        with self.cv:
            self._arrived(arrival)
            if rows and len(self.waiting) + rows > self.max_queue:
                self.metrics.rejected_queue_full += 1
                raise QueueFull(f"the queue is full ({len(self.waiting)} of {self.max_queue} rows waiting)")
            self.waiting.extend(items)
            self.metrics.queue_length = len(self.waiting)
            self.cv.notify()

    def cancel(self, items: list[RowJob | Task], reason: str = "cancelled") -> None:
        """Stop rows or tasks (client gone: "cancelled"; stop string matched: "stop"). Thread-safe."""
        with self.cv:
            for item in items:
                if item.state == "waiting":
                    item.state = "done"
                    try:
                        self.waiting.remove(item)
                    except ValueError:
                        pass
                    if isinstance(item, Task):
                        item.future.set_exception(Cancelled("the request was cancelled"))
                elif item.state == "running":
                    self.to_cancel.append((item, reason))
            self.metrics.queue_length = len(self.waiting)
            self.cv.notify()

    # ---- the thread --------------------------------------------------------------------------------
    def start(self) -> None:
        if self.runner == "compiled":
            self.compiles = Background(self.model)  # queues the graphs an earlier server left on disk
            self.metrics.graphs_compiled += self.compiles.load_noted()  # by their cache keys: no trace
            self.compiles.sync()  # shapes met before the server started (its warm-up)
            self.metrics.graphs_deferred = self.compiles.waiting()
        self.idle_since = time.perf_counter()  # a graph loads only after IDLE_BEFORE_COMPILE_S, from the start too
        self.thread = threading.Thread(target=self._loop, name="clover-scheduler", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if self.thread is not None:  # an idle compile (seconds) has no request to finish: not waited for
            self.thread.join(timeout=1 if self.compiling else 30)
        if self.compiles is not None:
            self.compiles.close()

    @property
    def running_rows(self) -> int:
        return sum(len(e.seqs) + len(e.prefilling) for e in self.engines.values())

    def _busy(self) -> bool:
        return bool(self.stopping or self.waiting or self.to_cancel or self.engines or self.core.running)

    def _loop(self) -> None:
        with torch.inference_mode():  # the thread's whole life: not entered and left again every turn
            self._turns()

    def _turns(self) -> None:
        while True:
            if not self._busy():
                self._flush()  # no graph call is coming to take the last turn's posts
            with self.cv:
                while not self._busy() and (wait := self._compile_wait()) != 0:
                    self.cv.wait(timeout=wait)
                idle = not self._busy()
            if idle:  # nothing to decode: load one graph the child compiled (or a fused layout)
                self._compile_one(traced=True)
                continue
            with self.cv:
                if self.stopping:
                    break
                self._gather()
                cancels, self.to_cancel = self.to_cancel, []
                admit = self._take(sum(isinstance(j, RowJob) and j.state == "running" for j, _ in cancels))
            try:
                with held_posts(defer=self.model if self.runner == "compiled" else None, pacer=self.pacer):
                    for item, reason in cancels:
                        self._cancel(item, reason)
                    self._admit(admit)
                    self._step_all()
            except Exception:  # never let the loop die: fail the rows and tasks involved, keep serving
                traceback.print_exc()
                self._flush()  # what the turn posted goes before the errors
                self._fail_all("internal error in the decoding loop")
            self.metrics.running_rows = self.running_rows
            self.idle_since = time.perf_counter()
            if self.compiles is not None:
                self.compiles.sync()  # the shapes new in this turn go to the compiling child
                self.metrics.graphs_deferred = queued = self.compiles.waiting()
                if queued:  # the child stopped but for its share of the time (with none queued it has nothing to do)
                    self.compiles.pace(decoding=True)
                if self.compiles.can_load():  # between turns: a graph loaded by its key takes milliseconds
                    self._flush()  # tokens held by the pacer too: none waits on the load
                    self._compile_one(traced=False)
        self._flush()
        with self.cv:  # nothing is left pending: every request gets its answer
            self._fail_all("the server is shutting down", waiting=True)

    def _flush(self) -> None:
        """Every post made or held so far, now."""
        flush_posts()
        deliver(self.pacer.release())

    def _gather(self) -> None:
        """(Under the lock) while only tasks that have not run a forward would run and other tasks are
        being planned (a burst of requests), wait for those, up to GATHER_S after the last arrival: the
        burst's first jobs then share one forward (and their common prefix) instead of the first arrivals
        running one of their own. A lone request never waits (nothing else is being planned)."""
        while (left := self._gather_for(time.perf_counter())) > 0:
            self.cv.wait(timeout=left)

    def _gather_for(self, now: float) -> float:
        """(Under the lock) how long `_gather` waits from `now` (0: not at all)."""
        if self.planning <= 0 or self.stopping or self.to_cancel or self.engines:
            return 0.0
        if not (all(isinstance(i, Task) for i in self.waiting) and all(j.fresh for j in self.core.jobs)):
            return 0.0
        return max(self.arrival + GATHER_S - now, 0.0)

    def _compile_wait(self) -> float | None:
        """(Idle, under the lock) 0: load a compiled graph now; else how long to wait before looking
        again (None: until a request comes). A load starts only after IDLE_BEFORE_COMPILE_S without
        work, so back-to-back requests do not wait for one."""
        if self.compiles is None:
            return None
        self.compiles.pace(decoding=False)  # idle: the compiling child runs
        if self.compiles.can_load():
            return 0.0
        if self.compiles.can_compile():
            return max(0.0, self.idle_since + IDLE_BEFORE_COMPILE_S - time.perf_counter())
        return COMPILE_POLL_S if self.compiles.in_flight() else None

    def _take(self, leaving: int) -> list[RowJob | Task]:
        """(Under the lock) the waiting tasks, and rows while fewer than `max_batch` run."""
        room = self.max_batch - self.running_rows + leaving
        admit, keep = [], deque()
        for item in self.waiting:
            fits = isinstance(item, Task) or room > 0
            room -= isinstance(item, RowJob) and fits
            (admit if fits else keep).append(item)
            item.state = "running" if fits else item.state
        self.waiting = keep
        self.metrics.queue_length = len(keep)
        return admit

    def _compile_one(self, traced: bool) -> None:
        """One deferred graph the child has compiled: loaded by its cache key (`Background.load_one`,
        milliseconds, between turns too), else with `traced` (only while no request runs: a request
        that arrives meanwhile waits for it, once per shape) compiled here (`compile_one`: a trace and
        a cache hit). A failed compile leaves that shape eager."""
        t0, done = time.perf_counter(), False
        self.compiling = True
        try:
            with torch.inference_mode():
                done = self.compiles.load_one() or (traced and self.compiles.compile_one())
        except Exception:  # noqa: BLE001 - the shape keeps running eagerly, as it did
            traceback.print_exc()
        finally:
            self.compiling = False
        with self.metrics.lock:
            self.metrics.compile_seconds += time.perf_counter() - t0
            self.metrics.graphs_compiled += int(done)
            self.metrics.graphs_deferred = self.compiles.waiting()

    def _admit(self, items: list[RowJob | Task]) -> None:
        """Rows join the engine of their key (prefilled as one batch per key); tasks start their jobs."""
        groups: dict[DecodeConfig, list[RowJob]] = {}
        for item in items:
            if isinstance(item, Task):
                self._run_task(item)
            else:
                groups.setdefault(item.key, []).append(item)
        for key, group in groups.items():
            try:
                self._join(key, group)
            except Exception as e:  # noqa: BLE001 - whatever it is, it belongs to these jobs only
                if len(group) == 1:
                    self._fail(group[0], e)
                    continue
                for job in group:  # which of them? each alone: the others are admitted
                    try:
                        self._join(key, [job])
                    except Exception as e1:  # noqa: BLE001
                        self._fail(job, e1)

    def _run_task(self, task: Task, done: SlotJob | None = None) -> None:
        """Resume a task with its finished job `done` (None: start its planned first job) until it has
        a running job or has ended; a job that fails at its start (prefill) is handed back at once."""
        job = task.job if done is None else task.resume(done)
        while job is not None:
            if task.state == "done":  # cancelled: the task ends with that at its yield
                job.fail(Cancelled("the request was cancelled"))
            else:
                self.core.join(job)
            if not job.finished:
                return
            job = task.resume(job)
        task.state = "done"

    def _step_all(self) -> None:
        """One forward for every engine, and for every task's job (jobs of one shape share one)."""
        for key in list(self.engines):
            self._step(key)
        if not self.core.running:
            return
        t0, before = time.perf_counter(), self.core.forwards
        for job in self.core.step():
            self._run_task(job.task, job)
        with self.metrics.lock:
            self.metrics.model_forwards += self.core.forwards - before
            self.metrics.step_seconds.observe(time.perf_counter() - t0)

    def _join(self, place, jobs: list[RowJob], resume: bool = False) -> None:
        """Prefill jobs into the engine at `place` (made when missing) and register them. `resume`: the
        jobs ran before; each restarts from prompt + committed tokens with the budget it has left."""
        engine = self.engines.get(place)
        if engine is None:
            key = place[0] if isinstance(place, tuple) else place
            engine = Engine(self.model, self.config(key, max(j.max_new_tokens for j in jobs)), defer_compile=True)
        olds = [j.seq if resume else None for j in jobs]
        seqs = engine.add([j.prompt_ids + (old.token_ids if old else []) for j, old in zip(jobs, olds)],
                          [old.remaining if old else j.max_new_tokens for j, old in zip(jobs, olds)], interleave=True)
        self.engines[place] = engine
        for job, seq, old in zip(jobs, seqs, olds):
            if old is not None:
                _carry_over(seq, old)
            job.seq, job.place, job.proven = seq, place, False
            self.jobs[id(seq)] = job
        if not resume:
            with self.metrics.lock:
                self.metrics.prompt_tokens += sum(len(j.prompt_ids) for j in jobs)

    def _step(self, place) -> None:
        engine = self.engines[place]
        t0, stepped = time.perf_counter(), list(engine.seqs)  # a long prompt's rows may join at the end of a step
        try:
            events = engine.step()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            self._isolate(place, e)
            return
        self.metrics.count_runner(engine.runner)
        for seq in stepped:
            job = self.jobs.get(id(seq))
            if job is not None:
                job.proven = True
        now = time.perf_counter()
        with self.metrics.lock:
            self.metrics.model_forwards += 1
            self.metrics.step_seconds.observe(now - t0)
            self.metrics.generated_tokens += sum(len(t) for _, t in events)
        for seq, tokens in events:
            job = self.jobs.get(id(seq))
            if job is None:
                continue
            if not job.first_block:
                job.first_block = True
                with self.metrics.lock:
                    self.metrics.first_token.observe(now - job.arrived)
            self._post(job, tokens)
        for row, seq in enumerate(engine.seqs):
            job = self.jobs.get(id(seq))
            if job is not None and job.live:
                job.ticket.post(Live("live", job.index, engine.block_view(row), _stats(seq)))
        if not engine.running:
            del self.engines[place]

    def _post(self, job: RowJob, tokens: list[int]) -> None:
        seq = job.seq
        steps = [s for _, s in seq.trajectory[len(seq.trajectory) - len(tokens):]]
        job.ticket.post(Tokens("tokens", job.index, list(seq.token_ids), tokens, steps, seq.finish_reason, _stats(seq)))
        if seq.finished:
            self._done(job, cancelled=False)

    def _isolate(self, place, error: Exception) -> None:
        """A step of the engine at `place` raised: with one row, that row fails. Otherwise the rows that
        joined since its last good step (suspects) go on solo and the others as one rebuilt batch; all
        solo when that tells nothing (no suspects, or no others). Moved rows restart from what they
        committed."""
        engine = self.engines.pop(place)
        jobs = [self.jobs[id(s)] for s in engine.seqs + engine.prefilling if id(s) in self.jobs]
        if len(jobs) == 1:
            self._fail(jobs[0], error)
            return
        key = place[0] if isinstance(place, tuple) else place
        live = []
        for job in jobs:
            if job.seq.finished:  # it finished in the step that raised, before its tokens were posted
                self._post(job, [])
            else:
                self.jobs.pop(id(job.seq), None)
                live.append(job)
        with self.metrics.lock:
            self.metrics.isolated_rows += len(live)
        proven = [j for j in live if j.proven]
        alone = live if len(proven) in (0, len(live)) else [j for j in live if not j.proven]
        if len(alone) < len(live):
            try:
                self._join(place, proven, resume=True)
            except Exception:  # noqa: BLE001 - then they go solo too
                alone = live
        for job in alone:
            try:
                self._join((key, id(job)), [job], resume=True)
            except Exception as e:  # noqa: BLE001
                self._fail(job, e)

    def _cancel(self, item: RowJob | Task, reason: str) -> None:
        if isinstance(item, Task):
            item.state = "done"
            job = item.job
            if job is not None and job in self.core.jobs:
                self.core.leave(job, Cancelled("the request was cancelled"))
                self._run_task(item, job)
            return
        engine = self.engines.get(item.place)
        if item.state != "running" or engine is None or item.seq is None:
            return
        engine.finish(item.seq, reason)
        self._done(item, cancelled=reason == "cancelled")
        if not engine.running:
            del self.engines[item.place]

    def _done(self, job: RowJob, cancelled: bool) -> None:
        job.state = "done"
        self.jobs.pop(id(job.seq), None)
        self.metrics.row_done(len(job.seq.token_ids), job.seq.forward_passes, cancelled)
        if not cancelled:
            with self.metrics.lock:
                self.metrics.latency.observe(time.perf_counter() - job.arrived)

    def _fail(self, job: RowJob, error: Exception) -> None:
        """End one job with an error its request answers with (500, OpenAI's shape)."""
        job.state = "done"
        if job.seq is not None:
            self.jobs.pop(id(job.seq), None)
        with self.metrics.lock:
            self.metrics.failed_rows += 1
        job.ticket.post(Failed("error", job.index, f"internal error while decoding this request ({type(error).__name__}); "
                                            "other requests are not affected"))

    def _fail_all(self, message: str, waiting: bool = False) -> None:
        """Every running row and task ends with an error (and, with `waiting`, the queued ones)."""
        for job in list(self.jobs.values()):
            job.state = "done"
            job.ticket.post(Failed("error", job.index, message))
        self.jobs.clear()
        self.engines.clear()
        for job in list(self.core.jobs):
            self.core.leave(job, RuntimeError(message))
            job.task.state = "done"
            self._run_task(job.task, job)
        for item in list(self.waiting) if waiting else []:
            item.state = "done"
            if isinstance(item, Task):
                item.future.set_exception(Cancelled(message))
            else:
                item.ticket.post(Failed("error", item.index, message))
        if waiting:
            self.waiting.clear()


def _carry_over(new: Sequence, old: Sequence) -> None:
    """A row re-prefilled from prompt + committed tokens keeps its request's view: the original
    prompt and budget, the tokens so far and their trajectory, forwards and start time."""
    new.prompt_ids, new.max_new_tokens = old.prompt_ids, old.max_new_tokens
    new.token_ids, new.trajectory = list(old.token_ids), list(old.trajectory)
    new.blocks, new.forward_passes, new.started = old.blocks, old.forward_passes, old.started


def _stats(seq: Sequence) -> dict:
    n = len(seq.token_ids)
    return {"tokens": n, "forwards": seq.forward_passes, "tpf": n / max(seq.forward_passes, 1),
            "tokens_per_second": n / max(seq.seconds, 1e-9)}
