"""When torch.compile compiles during a block of work, through dynamo's compile callbacks (the start
of each outermost compilation, whichever runner or fused function asked for it): a notice on the
first one (a compile of a new shape can take minutes on a CPU, and says nothing by itself), and the
time of the steps that compiled, so a speed can be reported without it. A step's whole time counts:
the first call of a new graph also waits for its kernels (compiled and loaded after dynamo's own
callback has ended)."""

from __future__ import annotations

import sys
import time


class CompileWatch:
    """Context manager over a loop of steps (call `mark()` after each): `intervals` [(start, end)] in
    time.perf_counter() seconds, one per step in which a compilation started (the block is one step
    when nothing marks it); `notice` is written once to `stream` when the first compilation starts,
    only when `stream` is a terminal."""

    def __init__(self, notice: str | None = None, stream=None):
        self.notice, self.stream = notice, stream if stream is not None else sys.stderr
        self.intervals: list[tuple[float, float]] = []
        self.plain_steps = 0  # steps in which nothing compiled
        self._mark = time.perf_counter()
        self._compiled = False
        self._told = False

    def _on_start(self, args) -> None:
        self._compiled = True
        if self.notice and not self._told and getattr(self.stream, "isatty", lambda: False)():
            self._told = True
            self.stream.write(self.notice + "\n")
            self.stream.flush()

    def mark(self) -> float:
        """A step ended (now, returned): it is a compile interval if a compilation started in it."""
        now = time.perf_counter()
        if self._compiled:
            self.intervals.append((self._mark, now))
        else:
            self.plain_steps += 1
        self._mark, self._compiled = now, False
        return now

    def __enter__(self) -> "CompileWatch":
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._on_start)
        self._mark, self._compiled, self.plain_steps = time.perf_counter(), False, 0
        return self

    def __exit__(self, *exc) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self._on_start)
        self.mark()

    def seconds_within(self, start: float, end: float) -> float:
        """Compile seconds inside [start, end]."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.intervals)

    def total(self) -> float:
        return sum(b - a for a, b in self.intervals)
