"""Slot infilling and grammar-constrained decoding as modes of the one core.

A `SlotJob` is one call of `denoise` (rows of units laid out in windows, engine/infill.py) or of
`decode_constrained` (next-token decoding under a grammar): its own `RowBatch` (prefilled when the
job starts) and a generator that holds the job's per-row state - window index, anchors, slot
commits, or the tokens so far and the grammar - and yields the `Forward` it needs next. Only
`RowBatch.forward` calls the model.

`SlotMode` runs many jobs side by side, rows joining and leaving between steps: each `step` gives
every job one forward (a job just started with no partner may sit out one step first: `ready`), and
jobs whose forwards have the same shape (window width, draft length, block size) and the same clean
window size of their pending segment share one batched forward
(`batch.merge` / `batch.split`: caches side by side, pending segments left-padded, which is what a
row computes alone - the padding is masked). Whole-window drafts (width = draft length = block size,
as infill's) of different widths share one too where the model takes per-row draft widths
(`ragged_drafts`, eager runner): narrower windows right-padded, the padding masked. Jobs of other
different shapes never share a forward, so a job's tokens do not depend on what runs beside it. A job's
failure (its prefill, its own logic, a forward it ran alone) stays with that job; a shared forward that
raises is retried job by job.

A `Task` is a request's whole decoding as a generator of jobs (`yield job` returns its result);
`drive(task)` runs one alone, the server's scheduler runs many, their jobs side by side.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Generator

import torch
import torch.nn.functional as F

from .batch import Forward, RowBatch, left_padded, merge, split


Steps = Generator[Forward, torch.Tensor, object]


class SlotJob:
    """One request's rows: `start(runner, defer)` prefills them with an engine of that runner (returns
    its RowBatch and its step generator), then each `advance(logits)` resumes the generator with the
    logits of the forward it asked for."""

    def __init__(self, start: Callable[..., tuple[RowBatch, Steps]]):
        self._start = start
        self.batch: RowBatch | None = None
        self.steps: Steps | None = None
        self.need: Forward | None = None
        self.result = None
        self.error: BaseException | None = None
        self.finished = False
        self.task: Task | None = None  # the task that yielded it
        self.fresh, self.waited = True, False  # before its first forward; whether it sat out a step (`ready`)
        self.ordinal = 0  # jobs its task ran before it

    def start(self, runner: str = "eager", defer: bool = False) -> None:
        self.batch, self.steps = self._start(runner=runner, defer=defer)
        self.advance(None)

    def advance(self, logits: torch.Tensor | None) -> None:
        self.fresh = self.fresh and logits is None
        try:
            self.need = self.steps.send(logits)
        except StopIteration as stop:
            self.need, self.result, self.finished = None, stop.value, True

    def fail(self, error: BaseException) -> None:
        self.need, self.error, self.finished = None, error, True

    def shape(self) -> tuple:
        n = self.need
        return ("ragged",) if self.ragged() else (n.window.shape[1], n.draft_len, n.keep, n.block_size)

    def ragged(self) -> bool:
        """Whether its forward may share one with windows of other widths: a whole-window draft (width =
        draft length = kept columns = block size) on a model and runner that take per-row draft widths."""
        n, runner = self.need, self.batch.runner
        return (0 < n.window.shape[1] == n.draft_len == n.keep == n.block_size and n.index is None
                and not n.sub_block_head and runner.name == "eager" and getattr(runner.model, "ragged_drafts", False))

    def clean_block_size(self) -> int | None:
        """The clean window size of the pending segment (None: nothing pending, fits any forward)."""
        return self.batch.clean_block_size if self.batch.pending is not None else None


def partition(jobs: list[SlotJob]) -> list[list[SlotJob]]:
    """Jobs that can share one forward: same shape and same pending clean window size (jobs with
    nothing pending join the first group of their shape)."""
    groups: dict[tuple, list[SlotJob]] = {}
    loose: list[SlotJob] = []
    for job in jobs:
        bs = job.clean_block_size()
        (loose if bs is None else groups.setdefault((job.shape(), bs), [])).append(job)
    for job in loose:
        key = next((k for k in groups if k[0] == job.shape()), (job.shape(), None))
        groups.setdefault(key, []).append(job)
    return list(groups.values())


def ready(groups: list[list[SlotJob]]) -> list[list[SlotJob]]:
    """The groups from `partition` that run this step. Jobs before their first forward sit out one step
    (once) while other groups run when their tasks are ahead of a task running beside them (more jobs
    done, `SlotJob.ordinal`), or when they have no partner and are their task's first (a request just
    arrived, whom one arriving a step later may join): of requests that arrived a step apart, the early
    ones' next jobs wait for the late ones' to reach the same phase, and from then on their jobs share
    forwards instead of running a step apart in forwards of their own. A later job with no partner whose
    task is behind no other does not wait: every task beside it is in its phase or past it, so waiting
    would only put its task a step behind theirs. A job's forwards, and so its tokens, do not change; it
    only starts a step later."""
    behind = min(j.ordinal for g in groups for j in g) if groups else 0
    wait = [g for g in groups if all(j.fresh and not j.waited for j in g)
            and (g[0].ordinal > behind or (len(g) == 1 and g[0].ordinal == 0))]
    if len(wait) == len(groups):
        return groups
    for g in wait:
        for j in g:
            j.waited = True
    return [g for g in groups if g not in wait]


def forward(group: list[SlotJob]) -> list[torch.Tensor]:
    """One model call for a group from `partition`; the logits of each job's rows."""
    need = group[0].need
    if len(group) == 1:
        return [group[0].batch.forward(need.window, need.draft_len, need.keep, need.block_size)]
    bs = next((b for b in (j.clean_block_size() for j in group) if b is not None), group[0].batch.clean_block_size)
    batches = [j.batch for j in group]
    merged = merge(batches, bs)
    if not batches[0].layout.absolute:
        share_prefixes(merged)
    widths = [j.need.window.shape[1] for j in group]
    if len(set(widths)) == 1:
        logits = merged.forward(torch.cat([j.need.window for j in group]), need.draft_len, need.keep, need.block_size)
    else:  # whole-window drafts (`SlotJob.ragged`), each row's window right-padded to the widest
        w = max(widths)
        window = torch.cat([F.pad(j.need.window, (0, w - n), value=j.batch.mask_id) for j, n in zip(group, widths)])
        logits = merged.forward(window, w, w, w, draft_lens=[n for b, n in zip(batches, widths) for _ in b.seqs])
    split(merged, batches)
    return [x[:, :n] for x, n in zip(logits.split([len(b.seqs) for b in batches]), widths)]


def share_prefixes(batch: RowBatch) -> None:
    """Before a forward of a merged batch: rows with nothing committed yet whose pending contexts start with
    the same tokens up to a clean window boundary of each (windows of `clean_block_size` anchored at the
    context's end: the same length modulo it) commit that prefix once, in a forward of one row per group (not
    counted: a commit, as prefill), copied into each row's cache; their pending segments keep the rest. The
    layout is unchanged, so each row computes what it would have alone (up to rounding). Only when the
    forward saves at least `split_min_saved` columns (padding included) beyond the prefixes' own."""
    if batch.pending is None or batch.split_min_saved is None:
        return
    clean, pad = batch.pending
    width, rows = batch.clean_block_size, _pending_rows(clean, pad)
    lens = batch.cache.lens.tolist()
    groups = prefix_groups([c if n == 0 else None for c, n in zip(rows, lens)], width)
    if not groups:
        return
    cut = {r: b for members, b in groups for r in members}
    rest = [c[cut.get(r, 0):] for r, c in enumerate(rows)]
    longest = max(b for _, b in groups)
    saved = len(rows) * (clean.shape[1] - max(map(len, rest))) - len(groups) * longest
    cap = batch.runner.prefill_chunk
    if saved < max(batch.split_min_saved, 1) or (cap and longest > cap):
        return
    ids, ids_pad = left_padded([rows[members[0]][:b] for members, b in groups], clean.device)
    cache = batch.runner.new_cache(len(groups), capacity=batch.cache.capacity)
    batch.runner.forward(ids, cache, clean_block_size=width, pad_mask=ids_pad, logits_to_keep=1)
    for g, (members, _) in enumerate(groups):
        batch.cache.put_rows(members, cache.copy_rows([g] * len(members)))
    ids, ids_pad = left_padded(rest, clean.device)
    batch.pending = (ids, ids_pad) if ids.shape[1] and (ids_pad is None or not bool(ids_pad.all())) else None


def prefix_groups(rows: list[list[int] | None], width: int) -> list[tuple[list[int], int]]:
    """Of contexts laid out in clean windows of `width` anchored at their ends (None: a row left out), the
    groups that share their first b tokens, b a window boundary of each: [(rows, b)]. A row that shares
    no such prefix with a row of its phase (its length modulo `width`) is a group of its own, b the boundary
    below what it shares with any row: committed apart, it leaves the shared forward only its tail.
    Rows sorted by their tokens meet their longest common prefixes side by side."""
    live = [r for r, c in enumerate(rows) if c]
    reach = {r: max([_common(rows[r], rows[o]) for o in live if o != r] + [0]) for r in live}
    phases: dict[int, list[int]] = {}
    for r in live:
        phases.setdefault(len(rows[r]) % width, []).append(r)
    out = []
    for phase, members in phases.items():
        members.sort(key=lambda r: rows[r])
        run, common = [members[0]], 0
        for r in members[1:] + [None]:
            shared = 0 if r is None else _boundary(_common(rows[run[-1]], rows[r]), phase, width)
            if shared and shared >= common // 2:
                run, common = run + [r], min(common, shared) if len(run) > 1 else shared
                continue
            b = common if len(run) > 1 else _boundary(reach[run[0]], phase, width)
            if b:
                out.append((run, b))
            run, common = [r], 0
    return out


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _boundary(n: int, phase: int, width: int) -> int:
    """The largest window boundary <= n of a context whose length is `phase` modulo `width` (0: none)."""
    b = n - (n - phase) % width
    return max(b, 0)


def _pending_rows(clean: torch.Tensor, pad: torch.Tensor | None) -> list[list[int]]:
    return [row[~p].tolist() if p is not None else row.tolist()
            for row, p in zip(clean, pad if pad is not None else [None] * len(clean))]


class SlotMode:
    """The running jobs; `join` starts one (its prefill), `step` advances every job by one forward
    and returns the jobs that finished (with a result or an error). `runner` / `defer`: how the jobs'
    engines call the model (the server's `--runner`; deferred compiles, as its engines)."""

    def __init__(self, runner: str = "eager", defer: bool = False):
        self.jobs: list[SlotJob] = []
        self.forwards = 0  # model calls made by `step` so far
        self.runner, self.defer = runner, defer

    @property
    def running(self) -> bool:
        return bool(self.jobs)

    def join(self, job: SlotJob) -> None:
        try:
            job.start(self.runner, self.defer)
        except Exception as e:  # noqa: BLE001 - the job's own failure (a prompt too long, ...)
            job.fail(e)
        if not job.finished:
            self.jobs.append(job)

    def leave(self, job: SlotJob, error: BaseException) -> None:
        """End a running job between steps (cancelled)."""
        if job in self.jobs:
            self.jobs.remove(job)
            job.fail(error)

    def step(self) -> list[SlotJob]:
        for group in ready(partition(self.jobs)):
            self.forwards += 1
            try:
                outs = forward(group)
            except Exception as e:  # noqa: BLE001 - which job? each alone
                if len(group) == 1:
                    group[0].fail(e)
                    continue
                outs = [self._alone(j) for j in group]
            for job, logits in zip(group, outs):
                if logits is not None and not job.finished:
                    try:
                        job.advance(logits)
                    except Exception as e:  # noqa: BLE001 - the job's own logic
                        job.fail(e)
        done = [j for j in self.jobs if j.finished]
        self.jobs = [j for j in self.jobs if not j.finished]
        return done

    @staticmethod
    def _alone(job: SlotJob) -> torch.Tensor | None:
        try:
            return forward([job])[0]
        except Exception as e:  # noqa: BLE001
            job.fail(e)
            return None


Tasks = Generator[SlotJob, object, object]  # yields the jobs it needs one after another, gets each one's result


class Task:
    """A request's whole decoding (a decision, a structured reply, forced tool calls) as a generator
    of jobs: it yields a `SlotJob`, gets its result back (or its error raised at the yield) and yields the
    next, doing only CPU planning in between; it returns the reply. `resume` runs it up to its next
    job (`self.job`), or to its end (`self.future` done). Whoever runs the jobs - `drive` alone, or
    the server's scheduler beside other requests - resumes it; nothing waits on anyone."""

    def __init__(self, steps: Tasks):
        self.steps, self.job, self.jobs = steps, None, 0  # jobs yielded so far
        self.future: Future = Future()
        self.state = "waiting"  # waiting -> running -> done (where a scheduler runs it)

    def resume(self, done: SlotJob | None = None) -> SlotJob | None:
        """Hand `done`'s result (or error) to the task; returns its next job, None when it ended."""
        try:
            if done is not None and done.error is not None:
                self.job = self.steps.throw(done.error)
            else:
                self.job = self.steps.send(None if done is None else done.result)
        except StopIteration as stop:
            self.job = None
            self.future.set_result(stop.value)
        except BaseException as e:  # noqa: BLE001 - the task's own error: its request answers with it
            self.job = None
            self.future.set_exception(e)
        if self.job is not None:
            self.job.task, self.job.ordinal = self, self.jobs
            self.jobs += 1
        return self.job


def drive(steps: Tasks):
    """Run a task to its result, each of its jobs alone (the Python API; the server batches them)."""
    task = Task(steps)
    job = task.resume()
    while job is not None:
        run_alone(job, check=False)
        job = task.resume(job)
    return task.future.result()


@torch.no_grad()
def run_alone(job: SlotJob, check: bool = True):
    mode = SlotMode()
    mode.join(job)
    while mode.running:
        mode.step()
    if check and job.error is not None:
        raise job.error
    return job.result
