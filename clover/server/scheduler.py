"""One background thread runs every decoding: continuous batching over the engine.

* A request becomes one `Job` per choice (row). Jobs wait in a bounded FIFO (`max_queue` rows;
  a full queue is refused up front, the HTTP layer answers 503 + Retry-After).
* Jobs are grouped by engine key (`DecodeConfig.engine_key`: all the decoding settings but the budget): rows
  that decode the same way share one `Engine`, so one batched forward serves them all. Each row
  has its own token budget (`Engine.add(..., max_new_tokens=[...])`).
* Loop: apply cancellations -> admit waiting jobs while fewer than `max_batch` rows run (each
  admitted group is prefilled as one batch and joins its engine's running rows; its first block
  starts there) -> one `step()` of every engine -> hand committed blocks to their jobs. A row leaves
  its engine when it finishes (EOS, budget) or is cancelled (client gone, stop string): its cache
  rows are freed at once (`Engine.finish`), and an engine with no rows is dropped.
* Structured replies (response_format, forced tool calls) and /v1/decide are planned in a worker
  thread each (`structured`: schema -> rows, verdict, retries), but every model forward they need
  is a job of the slot mode (engine/slots.py) run by this thread: `run_job` queues it, the loop
  prefills it and steps it beside the engines, one forward per job per loop turn, jobs of the same
  shape batched in one forward. Their failures stay theirs (the job's error is raised in its
  worker thread).
* `--runner compiled`: the engines and the slot jobs defer compiling (a step of a shape with no graph
  runs eagerly and queues the shape); with nothing to decode, the loop compiles one queued shape at a time
  (`runner.compile_deferred`), so no running request waits on a compile.
* Results cross to the asyncio side with `loop.call_soon_threadsafe` on the ticket's queue.
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
import contextvars
import threading
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, NamedTuple

import torch

from ..engine import DEFAULTS, DecodeConfig, Engine, Sequence
from ..engine.runner import compile_deferred, deferred
from ..engine.slots import Job as SlotJob
from ..engine.slots import SlotMode, driving
from .metrics import Metrics


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
    """Raised in a structured request's worker thread when its client went away."""


@dataclass(eq=False)
class Plan:
    """A structured request's worker: its slot jobs and whether its client went away."""

    cancelled: bool = False
    future: object = None


class Ticket:
    """One HTTP request's mailbox: the scheduler thread posts, the request's coroutine reads."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def post(self, item: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shutting down)
            pass


@dataclass(eq=False)
class Job:
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
    slot: object = None  # its engine's key in Scheduler.engines: the engine key, or (key, id) when solo
    proven: bool = False  # has taken part in a step of its current engine that did not raise


class Scheduler:
    def __init__(self, model, eos_token_ids: tuple[int, ...], max_batch: int = 32, max_queue: int = 256,
                 metrics: Metrics | None = None, runner: str = DEFAULTS.runner):
        self.model, self.eos, self.runner = model, tuple(eos_token_ids), runner
        self.max_batch, self.max_queue = max_batch, max_queue
        self.metrics = metrics or Metrics()
        self.cv = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.to_cancel: list[tuple[Job, str]] = []
        self.engines: dict[object, Engine] = {}  # engine key: shared engine; (key, id(job)): solo
        self.jobs: dict[int, Job] = {}  # id(seq) -> job, for running rows
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.compiling = False  # in `_compile_one` (nothing decoding)
        self.slots = SlotMode(runner, defer=True)  # the running infill / grammar jobs
        self.slot_waiting: list[tuple[SlotJob, threading.Event]] = []
        self.slot_events: dict[int, threading.Event] = {}  # id(job) -> set when it finished
        self.plan_of: dict[int, Plan] = {}  # id(job) -> the structured request it belongs to
        # structured replies and decisions are planned here, one thread each (their forwards come back to ours)
        self.planner = ThreadPoolExecutor(max_workers=max(max_batch, 1), thread_name_prefix="clover-plan")

    # ---- called from request handlers ----------------------------------------------------------
    def config(self, key: DecodeConfig, max_new_tokens: int = 1) -> DecodeConfig:
        """The engine config for a key (`DecodeConfig.engine_key`): this server's EOS ids and runner;
        raises ValueError (-> 400) for settings the model can't run."""
        return key.with_(max_new_tokens=max_new_tokens, eos_token_ids=self.eos, runner=self.runner).check(self.model)

    def submit(self, jobs: list[Job]) -> None:
        with self.cv:
            if len(self.waiting) + len(jobs) > self.max_queue:
                self.metrics.rejected_queue_full += 1
                raise QueueFull(f"the queue is full ({len(self.waiting)} of {self.max_queue} rows waiting)")
            self.waiting.extend(jobs)
            self.metrics.queue_length = len(self.waiting)
            self.cv.notify()

    def cancel(self, jobs: list[Job], reason: str = "cancelled") -> None:
        """Stop jobs (client gone: "cancelled"; stop string matched: "stop"). Thread-safe."""
        with self.cv:
            for job in jobs:
                if job.state == "waiting":
                    job.state = "done"
                    try:
                        self.waiting.remove(job)
                    except ValueError:
                        pass
                elif job.state == "running":
                    self.to_cancel.append((job, reason))
            self.metrics.queue_length = len(self.waiting)
            self.cv.notify()

    def structured(self, fn, *args) -> "Plan":
        """Start `fn(*args)` (structured output, a forced call, a decision) in a worker thread where every
        denoise / decode_constrained call becomes a job of this scheduler; await `plan.future`, or
        `cancel_plan(plan)` when its client is gone."""
        plan = Plan()

        def call():
            with driving(partial(self.run_job, plan)):
                return fn(*args)

        plan.future = asyncio.get_running_loop().run_in_executor(self.planner, contextvars.copy_context().run, call)
        return plan

    def run_job(self, plan: "Plan", job: SlotJob):
        """Called from a worker thread: queue a slot job, wait until the loop has run it, return its
        result (or raise its error)."""
        done = threading.Event()
        with self.cv:
            if self.stopping or plan.cancelled:
                raise Cancelled("the request was cancelled" if plan.cancelled else "the server is shutting down")
            self.plan_of[id(job)] = plan
            self.slot_waiting.append((job, done))
            self.cv.notify()
        done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def cancel_plan(self, plan: "Plan") -> None:
        """The client is gone: its running jobs leave between steps, its next ones are refused."""
        with self.cv:
            plan.cancelled = True
            self.cv.notify()

    # ---- the thread --------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="clover-scheduler", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if self.thread is not None:  # an idle compile (seconds) has no request to finish: not waited for
            self.thread.join(timeout=1 if self.compiling else 30)
        self.planner.shutdown(wait=False)

    @property
    def running_rows(self) -> int:
        return sum(len(e.seqs) for e in self.engines.values())

    def _busy(self) -> bool:
        return bool(self.stopping or self.waiting or self.to_cancel or self.engines or self.slot_waiting
                    or self.slots.running)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self._busy() and not (self.runner == "compiled" and deferred(self.model)):
                    self.cv.wait()
                idle = not self._busy()
            if idle:  # nothing to decode: compile one shape the compiled runner ran eagerly meanwhile
                self._compile_one()
                continue
            with self.cv:
                if self.stopping:
                    self._fail_slots(RuntimeError("the server is shutting down"))
                    return
                slot_admit, self.slot_waiting = self.slot_waiting, []
                slot_gone = [j for j in self.slots.jobs if self.plan_of[id(j)].cancelled]
                cancels, self.to_cancel = self.to_cancel, []
                admit, room = [], self.max_batch - self.running_rows + sum(j.state == "running" for j, _ in cancels)
                while self.waiting and len(admit) < room:
                    job = self.waiting.popleft()
                    job.state = "running"
                    admit.append(job)
                self.metrics.queue_length = len(self.waiting)
            try:
                with torch.inference_mode():
                    for job, reason in cancels:
                        self._cancel(job, reason)
                    self._admit(admit)
                    for job in slot_gone:
                        self.slots.leave(job, Cancelled("the request was cancelled"))
                        self._slot_done(job)
                    self._admit_slots(slot_admit)
                    for key in list(self.engines):
                        self._step(key)
                    self._step_slots()
            except Exception as e:  # never let the loop die: fail the rows involved, keep serving
                traceback.print_exc()
                self._fail_all("internal error in the decoding loop")
                self._fail_slots(e)
            self.metrics.running_rows = self.running_rows
            if self.runner == "compiled":
                self.metrics.graphs_deferred = deferred(self.model)

    def _compile_one(self) -> None:
        """One deferred graph (`runner.compile_deferred`): seconds, while no request is running; a request
        that arrives meanwhile waits for it, once per shape. A failed compile leaves that shape eager."""
        t0, done = time.perf_counter(), False
        self.compiling = True
        try:
            with torch.inference_mode():
                done = compile_deferred(self.model)
        except Exception:  # noqa: BLE001 - the shape keeps running eagerly, as it did
            traceback.print_exc()
        finally:
            self.compiling = False
        with self.metrics.lock:
            self.metrics.compile_seconds += time.perf_counter() - t0
            self.metrics.graphs_compiled += int(done)
            self.metrics.graphs_deferred = deferred(self.model)

    def _admit(self, jobs: list[Job]) -> None:
        groups: dict[DecodeConfig, list[Job]] = {}
        for job in jobs:
            groups.setdefault(job.key, []).append(job)
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

    def _admit_slots(self, admit: list[tuple[SlotJob, threading.Event]]) -> None:
        for job, done in admit:
            self.slot_events[id(job)] = done
            if self.plan_of[id(job)].cancelled:
                job.fail(Cancelled("the request was cancelled"))
            else:
                self.slots.join(job)  # prefill; a job that fails there is finished with its error
            if job.finished:
                self._slot_done(job)

    def _step_slots(self) -> None:
        if not self.slots.running:
            return
        t0, before = time.perf_counter(), self.slots.forwards
        for job in self.slots.step():
            self._slot_done(job)
        with self.metrics.lock:
            self.metrics.model_forwards += self.slots.forwards - before
            self.metrics.step_seconds.observe(time.perf_counter() - t0)

    def _slot_done(self, job: SlotJob) -> None:
        self.plan_of.pop(id(job), None)
        self.slot_events.pop(id(job)).set()

    def _fail_slots(self, error: Exception) -> None:
        for job in list(self.slots.jobs):
            self.slots.leave(job, error)
        for job, done in self.slot_waiting:
            job.fail(error)
            done.set()
        self.slot_waiting = []
        for done in self.slot_events.values():
            done.set()
        self.slot_events.clear()
        self.plan_of.clear()

    def _join(self, slot, jobs: list[Job], resume: bool = False) -> None:
        """Prefill jobs into the engine at `slot` (made when missing) and register them. `resume`: the
        jobs ran before; each restarts from prompt + committed tokens with the budget it has left."""
        engine = self.engines.get(slot)
        if engine is None:
            key = slot[0] if isinstance(slot, tuple) else slot
            engine = Engine(self.model, self.config(key, max(j.max_new_tokens for j in jobs)), defer_compile=True)
        olds = [j.seq if resume else None for j in jobs]
        seqs = engine.add([j.prompt_ids + (old.token_ids if old else []) for j, old in zip(jobs, olds)],
                          [old.remaining if old else j.max_new_tokens for j, old in zip(jobs, olds)])
        self.engines[slot] = engine
        for job, seq, old in zip(jobs, seqs, olds):
            if old is not None:
                _carry_over(seq, old)
            job.seq, job.slot, job.proven = seq, slot, False
            self.jobs[id(seq)] = job
        if not resume:
            with self.metrics.lock:
                self.metrics.prompt_tokens += sum(len(j.prompt_ids) for j in jobs)

    def _step(self, slot) -> None:
        engine = self.engines[slot]
        t0 = time.perf_counter()
        try:
            events = engine.step()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            self._isolate(slot, e)
            return
        for seq in engine.seqs:
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
            del self.engines[slot]

    def _post(self, job: Job, tokens: list[int]) -> None:
        seq = job.seq
        steps = [s for _, s in seq.trajectory[len(seq.trajectory) - len(tokens):]]
        job.ticket.post(Tokens("tokens", job.index, list(seq.token_ids), tokens, steps, seq.finish_reason, _stats(seq)))
        if seq.finished:
            self._done(job, cancelled=False)

    def _isolate(self, slot, error: Exception) -> None:
        """A step of the engine at `slot` raised: with one row, that row fails. Otherwise the rows that
        joined since its last good step (suspects) go on solo and the others as one rebuilt batch; all
        solo when that tells nothing (no suspects, or no others). Moved rows restart from what they
        committed."""
        engine = self.engines.pop(slot)
        jobs = [self.jobs[id(s)] for s in engine.seqs if id(s) in self.jobs]
        if len(jobs) == 1:
            self._fail(jobs[0], error)
            return
        key = slot[0] if isinstance(slot, tuple) else slot
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
                self._join(slot, proven, resume=True)
            except Exception:  # noqa: BLE001 - then they go solo too
                alone = live
        for job in alone:
            try:
                self._join((key, id(job)), [job], resume=True)
            except Exception as e:  # noqa: BLE001
                self._fail(job, e)

    def _cancel(self, job: Job, reason: str) -> None:
        engine = self.engines.get(job.slot)
        if job.state != "running" or engine is None or job.seq is None:
            return
        engine.finish(job.seq, reason)
        self._done(job, cancelled=reason == "cancelled")
        if not engine.running:
            del self.engines[job.slot]

    def _done(self, job: Job, cancelled: bool) -> None:
        job.state = "done"
        self.jobs.pop(id(job.seq), None)
        self.metrics.row_done(len(job.seq.token_ids), job.seq.forward_passes, cancelled)
        if not cancelled:
            with self.metrics.lock:
                self.metrics.latency.observe(time.perf_counter() - job.arrived)

    def _fail(self, job: Job, error: Exception) -> None:
        """End one job with an error its request answers with (500, OpenAI's shape)."""
        job.state = "done"
        if job.seq is not None:
            self.jobs.pop(id(job.seq), None)
        with self.metrics.lock:
            self.metrics.failed_rows += 1
        job.ticket.post(Failed("error", job.index, f"internal error while decoding this request ({type(error).__name__}); "
                                            "other requests are not affected"))

    def _fail_all(self, message: str) -> None:
        for job in list(self.jobs.values()):
            job.state = "done"
            job.ticket.post(Failed("error", job.index, message))
        self.jobs.clear()
        self.engines.clear()


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
