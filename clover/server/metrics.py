"""Server metrics in the Prometheus text format (no client library: a few counters, gauges and
histograms behind one lock)."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for bound, n in zip(self.buckets, self.counts):
            cum += n
            out.append(f'{name}_bucket{{le="{bound}"}} {cum}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = defaultdict(int)  # (endpoint, status) -> count
        self.prompt_tokens = self.generated_tokens = self.row_forwards = self.model_forwards = 0
        self.finished_rows = self.cancelled_rows = self.failed_rows = self.isolated_rows = self.rejected_queue_full = 0
        self.queue_length = self.running_rows = 0
        self.structured_replies = 0  # response_format / forced tool call replies (also in the token counters)
        self.graphs_compiled = self.graphs_deferred = 0  # --runner compiled: compiled when idle / waiting for it
        self.compile_seconds = 0.0
        self.graph_forwards = self.eager_forwards = 0  # --runner compiled: engine forwards by a graph / eagerly
        self.latency = Histogram()  # request arrival -> last token
        self.first_token = Histogram()  # request arrival -> first block
        self.step_seconds = Histogram((0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))

    def count_request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def row_done(self, tokens: int, forwards: int, cancelled: bool) -> None:
        with self.lock:
            self.row_forwards += forwards
            self.finished_rows += 1
            self.cancelled_rows += int(cancelled)

    def structured_done(self, prompt_tokens: int, completion_tokens: int, forwards: int, rows: int,
                        seconds: float) -> None:
        """A structured reply (response_format, forced tool calls) of `rows` choices, counted as the
        scheduler counts a generated row: tokens, forwards, latency (its whole reply is its first block)."""
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += completion_tokens
            self.row_forwards += forwards
            self.finished_rows += rows
            self.structured_replies += 1
            for _ in range(rows):
                self.latency.observe(seconds)
                self.first_token.observe(seconds)

    def count_runner(self, runner) -> None:
        """A compiled runner's forwards since the last count, by how they ran: a graph (`compiled_calls`)
        or eagerly (`eager_calls`: a shape with no graph yet, or one no graph is made for). Other runners
        are not counted."""
        done = (getattr(runner, "compiled_calls", None), getattr(runner, "eager_calls", None))
        if None in done:
            return
        seen = getattr(runner, "_counted", (0, 0))
        runner._counted = done
        with self.lock:
            self.graph_forwards += done[0] - seen[0]
            self.eager_forwards += done[1] - seen[1]

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / self.row_forwards if self.row_forwards else 0.0

    def render(self) -> str:
        with self.lock:
            lines = ["# HELP clover_requests_total HTTP requests answered, by endpoint and status.",
                     "# TYPE clover_requests_total counter"]
            lines += [f'clover_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            for name, kind, value, help_ in (
                ("clover_prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens admitted."),
                ("clover_generated_tokens_total", "counter", self.generated_tokens, "Tokens generated (committed blocks)."),
                ("clover_row_forward_passes_total", "counter", self.row_forwards,
                 "Model forwards summed over the rows of finished requests."),
                ("clover_tokens_per_forward", "gauge", round(self.tokens_per_forward, 4),
                 "Generated tokens per forward pass of a row (TPF), over finished rows."),
                ("clover_model_forwards_total", "counter", self.model_forwards, "Batched engine steps."),
                ("clover_finished_rows_total", "counter", self.finished_rows, "Rows (choices) that left the batch."),
                ("clover_cancelled_rows_total", "counter", self.cancelled_rows,
                 "Rows cancelled because their client went away."),
                ("clover_failed_rows_total", "counter", self.failed_rows,
                 "Rows ended by an error in their own admission or decoding (other rows go on)."),
                ("clover_isolated_rows_total", "counter", self.isolated_rows,
                 "Rows moved to an engine of their own after a batched step raised."),
                ("clover_rejected_queue_full_total", "counter", self.rejected_queue_full, "Requests answered 503."),
                ("clover_structured_replies_total", "counter", self.structured_replies,
                 "Structured replies (response_format, forced tool calls), also counted in the token and latency metrics."),
                ("clover_queue_length", "gauge", self.queue_length, "Rows waiting for a batch slot."),
                ("clover_graphs_deferred", "gauge", self.graphs_deferred,
                 "--runner compiled: step shapes run eagerly so far, waiting to be compiled when the server is idle."),
                ("clover_graphs_compiled_total", "counter", self.graphs_compiled,
                 "--runner compiled: graphs compiled while the server was idle."),
                ("clover_compile_seconds_total", "counter", round(self.compile_seconds, 3),
                 "--runner compiled: seconds spent compiling them."),
                ("clover_graph_forwards_total", "counter", self.graph_forwards,
                 "--runner compiled: decoding forwards that ran a compiled graph."),
                ("clover_eager_forwards_total", "counter", self.eager_forwards,
                 "--runner compiled: decoding forwards that ran eagerly (no graph for the shape yet, or none made for it)."),
                ("clover_running_rows", "gauge", self.running_rows, "Rows in the running batch."),
            ):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
            for name, hist, help_ in (
                ("clover_request_latency_seconds", self.latency, "Arrival to last token, per row."),
                ("clover_time_to_first_block_seconds", self.first_token, "Arrival to first committed block, per row."),
                ("clover_step_seconds", self.step_seconds, "One engine step (one batched forward)."),
            ):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + hist.lines(name)
        return "\n".join(lines) + "\n"
