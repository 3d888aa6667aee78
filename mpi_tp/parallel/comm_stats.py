"""The counters of every collective: calls, buffer bytes, wire bytes and seconds, per group and kind.

`Group` (mpi_tp.parallel.collectives) records each call here under the key
"group/kind" (e.g. "tp/all_reduce"); `mpi-tp bench`, `mpi-tp explain`, the
exercises and the run's metrics read them.

Buffer bytes (`bytes`) are the size of the array handed to the collective, n:
an all-reduce of (B, S, C) float32 counts B S C 4, an all-gather counts the
gathered array, a reduce-scatter the array that is reduced. Wire bytes
(`wire`) are what each rank sends in the bandwidth-optimal (ring) algorithm
for a group of T ranks: all-reduce 2 (T-1)/T n, all-gather and reduce-scatter
(T-1)/T n each, so a reduce-scatter followed by an all-gather moves exactly
what one all-reduce moves (docs/notation.md, "Bytes"; docs/costmodel.md
derives them). An all-to-all (expert parallelism's token exchange) counts, as
bytes and wire bytes alike, what this rank sends to the other ranks: its
block for itself stays where it is.
"""
from __future__ import annotations

import time
from collections import defaultdict


class CommStats:
    """Calls, bytes and seconds of every collective, keyed by "group/kind" (e.g. "tp/all_reduce")."""

    def __init__(self):
        self.calls = defaultdict(int)
        self.bytes = defaultdict(int)
        self.wire = defaultdict(float)
        self.seconds = defaultdict(float)
        self.trace = None            # a mpi_tp.parallel.trace.Trace: every call also becomes an event

    def record(self, key: str, nbytes: int, seconds: float, wire: float = 0.0, timed: bool = True) -> None:
        """Count one call. timed: it has just ended, `seconds` after it began (a non-blocking start
        is not: its time, and its trace event, come when it completes)."""
        self.calls[key] += 1
        self.bytes[key] += int(nbytes)
        self.wire[key] += wire
        self.seconds[key] += seconds
        if self.trace is not None and timed:
            now = time.perf_counter()
            self.trace.complete(key, "comm", now - seconds, now, bytes=int(nbytes))

    def reset(self) -> None:
        for d in (self.calls, self.bytes, self.wire, self.seconds):
            d.clear()

    def snapshot(self) -> dict:
        """{key: {"calls", "bytes", "wire_bytes", "seconds"}} for every key seen so far."""
        return {k: {"calls": self.calls[k], "bytes": self.bytes[k], "wire_bytes": round(self.wire[k]),
                    "seconds": self.seconds[k]} for k in sorted(self.calls)}

    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def total_bytes(self) -> int:
        return sum(self.bytes.values())
