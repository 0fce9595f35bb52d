"""Slot infilling and grammar-constrained decoding as modes of the one core.

A `Job` is one call of `denoise` (rows of units laid out in windows, engine/infill.py) or of
`decode_constrained` (next-token decoding under a grammar): its own `RowBatch` (prefilled when the
job starts) and a generator that holds the job's per-row state - window index, anchors, slot
commits, or the tokens so far and the grammar - and yields the `Forward` it needs next. Only
`RowBatch.forward` calls the model.

`SlotMode` runs many jobs side by side, rows joining and leaving between steps: each `step` gives
every job one forward, and jobs whose forwards have the same shape (window width, draft length,
block size) and the same clean window size of their pending segment share one batched forward
(`batch.merge` / `batch.split`: caches side by side, pending segments left-padded, which is what a
row computes alone - the padding is masked). Jobs of different shapes never share a forward, so a
job's tokens do not depend on what runs beside it. A job's failure (its prefill, its own logic, a
forward it ran alone) stays with that job; a shared forward that raises is retried job by job.

`run(job)` runs one job to the end: through the driver installed with `driving(...)` (the server's
scheduler, which batches it with other requests' jobs), or alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Generator

import torch

from .batch import Forward, RowBatch, merge, split


Steps = Generator[Forward, torch.Tensor, object]


class Job:
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

    def start(self, runner: str = "eager", defer: bool = False) -> None:
        self.batch, self.steps = self._start(runner=runner, defer=defer)
        self.advance(None)

    def advance(self, logits: torch.Tensor | None) -> None:
        try:
            self.need = self.steps.send(logits)
        except StopIteration as stop:
            self.need, self.result, self.finished = None, stop.value, True

    def fail(self, error: BaseException) -> None:
        self.need, self.error, self.finished = None, error, True

    def shape(self) -> tuple:
        n = self.need
        return n.window.shape[1], n.draft_len, n.keep, n.block_size

    def clean_bs(self) -> int | None:
        """The clean window size of the pending segment (None: nothing pending, fits any forward)."""
        return self.batch.clean_bs if self.batch.pending is not None else None


def partition(jobs: list[Job]) -> list[list[Job]]:
    """Jobs that can share one forward: same shape and same pending clean window size (jobs with
    nothing pending join the first group of their shape)."""
    groups: dict[tuple, list[Job]] = {}
    loose: list[Job] = []
    for job in jobs:
        bs = job.clean_bs()
        (loose if bs is None else groups.setdefault((job.shape(), bs), [])).append(job)
    for job in loose:
        key = next((k for k in groups if k[0] == job.shape()), (job.shape(), None))
        groups.setdefault(key, []).append(job)
    return list(groups.values())


def forward(group: list[Job]) -> list[torch.Tensor]:
    """One model call for a group from `partition`; the logits of each job's rows."""
    need = group[0].need
    if len(group) == 1:
        return [group[0].batch.forward(need.window, need.draft_len, need.keep, need.block_size)]
    bs = next((b for b in (j.clean_bs() for j in group) if b is not None), group[0].batch.clean_bs)
    batches = [j.batch for j in group]
    merged = merge(batches, bs)
    window = torch.cat([j.need.window for j in group])
    logits = merged.forward(window, need.draft_len, need.keep, need.block_size)
    split(merged, batches)
    return list(logits.split([len(b.seqs) for b in batches]))


class SlotMode:
    """The running jobs; `join` starts one (its prefill), `step` advances every job by one forward
    and returns the jobs that finished (with a result or an error). `runner` / `defer`: how the jobs'
    engines call the model (the server's `--runner`; deferred compiles, as its engines)."""

    def __init__(self, runner: str = "eager", defer: bool = False):
        self.jobs: list[Job] = []
        self.forwards = 0  # model calls made by `step` so far
        self.runner, self.defer = runner, defer

    @property
    def running(self) -> bool:
        return bool(self.jobs)

    def join(self, job: Job) -> None:
        try:
            job.start(self.runner, self.defer)
        except Exception as e:  # noqa: BLE001 - the job's own failure (a prompt too long, ...)
            job.fail(e)
        if not job.finished:
            self.jobs.append(job)

    def leave(self, job: Job, error: BaseException) -> None:
        """End a running job between steps (cancelled)."""
        if job in self.jobs:
            self.jobs.remove(job)
            job.fail(error)

    def step(self) -> list[Job]:
        for group in partition(self.jobs):
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
    def _alone(job: Job) -> torch.Tensor | None:
        try:
            return forward([job])[0]
        except Exception as e:  # noqa: BLE001
            job.fail(e)
            return None


_DRIVER: contextvars.ContextVar[Callable[[Job], object] | None] = contextvars.ContextVar("clover_slot_driver",
                                                                                        default=None)


@contextlib.contextmanager
def driving(driver: Callable[[Job], object]):
    """Within this context (this thread), `run` hands jobs to `driver(job) -> result`."""
    token = _DRIVER.set(driver)
    try:
        yield
    finally:
        _DRIVER.reset(token)


def run(job: Job):
    """Run a job to its result: through the installed driver, or alone."""
    driver = _DRIVER.get()
    if driver is not None:
        return driver(job)
    return run_alone(job)


@torch.no_grad()
def run_alone(job: Job):
    mode = SlotMode()
    mode.join(job)
    while mode.running:
        mode.step()
    if job.error is not None:
        raise job.error
    return job.result
