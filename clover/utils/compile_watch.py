"""When torch.compile compiles during a block of work, through dynamo's compile callbacks (start /
end of each outermost compilation, whichever runner or fused function asked for it): a notice on
the first one (a compile of a new shape can take minutes on a CPU, and says nothing by itself),
and the intervals, so a speed can be reported without the compile time in it."""

from __future__ import annotations

import sys
import time


class CompileWatch:
    """Context manager: `intervals` [(start, end)] in time.perf_counter() seconds; `notice` is
    written once to `stream` when the first compilation starts, only when `stream` is a terminal."""

    def __init__(self, notice: str | None = None, stream=None):
        self.notice, self.stream = notice, stream if stream is not None else sys.stderr
        self.intervals: list[tuple[float, float]] = []
        self._start = None
        self._told = False

    def _on_start(self, args) -> None:
        self._start = time.perf_counter()
        if self.notice and not self._told and getattr(self.stream, "isatty", lambda: False)():
            self._told = True
            self.stream.write(self.notice + "\n")
            self.stream.flush()

    def _on_end(self, args) -> None:
        if self._start is not None:
            self.intervals.append((self._start, time.perf_counter()))
            self._start = None

    def __enter__(self) -> "CompileWatch":
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)
        return self

    def __exit__(self, *exc) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self._on_start)
        callback_handler.remove_end_callback(self._on_end)

    def seconds_within(self, start: float, end: float) -> float:
        """Compile seconds inside [start, end]."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.intervals)

    def total(self) -> float:
        return sum(b - a for a, b in self.intervals)
