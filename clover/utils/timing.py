"""Side-by-side timing for benchmarks on shared, noisy machines: warm up,
then run the candidates alternately A B A B ... and report medians, so that load from other
processes hits every candidate alike. Benchmarks only; tests never assert times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def time_alternately(candidates: dict[str, Callable[[], object]], repeats: int = 20, warmup: int = 3,
                     setup: Callable[[str], object] | None = None,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each candidate. `setup(name)`, if given, runs untimed before each call.
    `clock`: wall time by default; `time.thread_time` counts only this thread's CPU time, which on an
    oversubscribed machine leaves out the time the scheduler gave other processes."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for i in range(warmup + repeats):
        for name, fn in candidates.items():
            if setup is not None:
                setup(name)
            start = clock()
            fn()
            elapsed = clock() - start
            if i >= warmup:
                samples[name].append(elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}
