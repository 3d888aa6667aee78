"""GET /metrics: what the server has done and is doing, in the Prometheus text format (version 0.0.4).

    mpi_tp_requests_total{status="200"}          completions answered, by HTTP status (429: queue full, 499: the
                                                 client left, 504: its deadline passed)
    mpi_tp_other_requests_total{path="/metrics"} everything else (scrapes, /health, /v1/models, unknown paths)
    mpi_tp_deadlines_total                       completions ended by their deadline (timeout, --request-timeout)
    mpi_tp_queue_depth, mpi_tp_running_rows      requests waiting; rows in the running batch
    mpi_tp_open_connections                      connections being handled
    mpi_tp_tokens_generated_total                bytes generated (a token is a byte)
    mpi_tp_cancelled_total                       requests whose client went away before the end
    mpi_tp_refused_connections_total             connections over --max-connections (answered 503)
    mpi_tp_read_timeouts_total                   clients too slow to send their request (closed)
    mpi_tp_time_to_first_token_seconds           histogram: from the request's arrival to its first byte
    mpi_tp_time_per_output_token_seconds         histogram: between two bytes of one request
    process_resident_memory_bytes                rank 0's resident memory

Counters and histograms are kept by the HTTP threads and the scheduler under one lock; gauges are
read when scraped.
"""
from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, x: float) -> None:
        i = bisect.bisect_left(self.buckets, x)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum, self.count = self.sum + x, self.count + 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for le, n in zip(self.buckets, self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{le:g}"}} {total}')
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.status, self.tokens, self.cancelled, self.refused, self.read_timeouts = {}, 0, 0, 0, 0
        self.other, self.deadlines = {}, 0
        self.ttft, self.tpot = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, what, getattr(self, what) + n)

    def answered(self, status: int, path: str | None = None) -> None:
        """A completion answered with `status`; or (path) another request, counted apart."""
        with self.lock:
            table, key = (self.status, status) if path is None else (self.other, path)
            table[key] = table.get(key, 0) + 1

    def token(self, first: bool, seconds: float) -> None:
        """One generated token of a request: seconds since its arrival (first) or since its last token."""
        with self.lock:
            self.tokens += 1
            (self.ttft if first else self.tpot).observe(seconds)

    def render(self, gauges: dict) -> str:
        """The exposition text; gauges: name -> value (queue_depth, running_rows, open_connections)."""
        def head(name, kind, text):
            return [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        with self.lock:
            out = head("mpi_tp_requests_total", "counter", "Requests answered, by HTTP status.")
            out += [f'mpi_tp_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.status.items())]
            out += head("mpi_tp_other_requests_total", "counter", "Other requests (scrapes, /health, /v1/models).")
            out += [f'mpi_tp_other_requests_total{{path="{p}"}} {n}' for p, n in sorted(self.other.items())]
            for name, text in (("queue_depth", "Requests waiting for a row."),
                               ("running_rows", "Rows in the running batch."),
                               ("open_connections", "Connections being handled.")):
                out += head(f"mpi_tp_{name}", "gauge", text) + [f"mpi_tp_{name} {gauges[name]}"]
            for name, value, text in (("tokens_generated", self.tokens, "Tokens generated."),
                                      ("cancelled", self.cancelled, "Requests whose client went away."),
                                      ("refused_connections", self.refused, "Connections over the cap."),
                                      ("read_timeouts", self.read_timeouts, "Requests not sent in time."),
                                      ("deadlines", self.deadlines, "Completions ended by their deadline.")):
                out += head(f"mpi_tp_{name}_total", "counter", text) + [f"mpi_tp_{name}_total {value}"]
            out += head("mpi_tp_time_to_first_token_seconds", "histogram", "Arrival to first token.")
            out += self.ttft.lines("mpi_tp_time_to_first_token_seconds")
            out += head("mpi_tp_time_per_output_token_seconds", "histogram", "Between two tokens of a request.")
            out += self.tpot.lines("mpi_tp_time_per_output_token_seconds")
        out += head("process_resident_memory_bytes", "gauge", "Resident memory of rank 0.")
        return "\n".join(out + [f"process_resident_memory_bytes {resident_bytes()}"]) + "\n"
