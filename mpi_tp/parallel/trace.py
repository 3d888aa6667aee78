"""A per-rank timeline of a run in the Chrome trace event format (open it in Perfetto or chrome://tracing).

    trace = Trace(comm)                  # every rank; the clocks are aligned by a barrier here
    topo.stats.trace = trace             # every counted collective and send/receive becomes an event
    with trace.span("forward", "compute", step=3): ...
    trace.write("run.trace.json", comm)  # rank 0 writes every rank's events, one "process" per rank

Events are complete events ("ph": "X") with a start and a duration in
microseconds since the barrier, the rank as the process id, and arguments
(bytes moved, micro-batch, chunk, step). The schedule's pictures in `mpi-tp
explain --layer pipeline` are drawn from these timestamps.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

from mpi_tp.core import backend


class Trace:
    """The events of this rank."""

    def __init__(self, comm=None, synchronize: bool = False):
        """synchronize: each span waits for the device's queued work before it ends (what a timing of
        phases on a GPU needs: mpi-tp bench); off, a span is the host's time."""
        self.rank, self.synchronize = (comm.Get_rank() if comm is not None else 0), synchronize
        if comm is not None:
            comm.Barrier()                      # every rank's zero is the same moment, within a barrier's skew
        self.t0 = time.perf_counter()
        self.events: list[dict] = []

    def complete(self, name: str, cat: str, start: float, end: float, **args) -> None:
        """An event from perf_counter() `start` to `end`."""
        self.events.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": 0,
                            "ts": round((start - self.t0) * 1e6, 3), "dur": round((end - start) * 1e6, 3),
                            "args": args})

    @contextmanager
    def span(self, name: str, cat: str, **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize:
                backend.synchronize()
            self.complete(name, cat, start, time.perf_counter(), **args)

    def write(self, path: str, comm) -> None:
        """Rank 0 writes every rank's events (gathered once, at the end) to `path`, atomically."""
        everyone = comm.gather(self.events, root=0)
        if comm.Get_rank() != 0:
            return
        names = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
                 for r in range(len(everyone))]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": names + [e for events in everyone for e in events],
                       "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)


@contextmanager
def span(trace: Trace | None, name: str, cat: str, **args):
    """trace.span(...) when tracing, nothing otherwise: for code that runs either way."""
    if trace is None:
        yield
    else:
        with trace.span(name, cat, **args):
            yield
