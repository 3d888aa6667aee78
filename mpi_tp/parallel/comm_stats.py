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

Seconds (`seconds`) are the time this rank was held in communication: inside
a blocking collective's call, or inside the calls that start, test, wait for
or cancel a non-blocking operation (not the time it was in flight while the
rank computed: a pipeline's receive posted early, a data-parallel bucket's
all-reduce under the backward pass). The intervals never overlap: a wait
inside another (ring attention's `cp/ring_wait` around its sends' and
receives' waits) is counted once, by the outer one. So the seconds summed
over every key are at most the wall time they were counted over, and
`mpi-tp train`'s `comm` share is at most 100%.

Phases: every count also lands in the phase the run was in (`phase`: the
training steps, evaluation, checkpoints; "other" outside them: setup, the
logged steps' reports), so that run.json keeps a step's traffic apart from
the run's one-time traffic (`phases()`).
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

OTHER = "other"           # the phase of whatever is counted outside a named one


class Counters:
    """Calls, buffer bytes, wire bytes and seconds, keyed by "group/kind"."""

    def __init__(self):
        self.calls = defaultdict(int)
        self.bytes = defaultdict(int)
        self.wire = defaultdict(float)
        self.seconds = defaultdict(float)

    def add(self, key: str, nbytes: int, wire: float) -> None:
        self.calls[key] += 1
        self.bytes[key] += int(nbytes)
        self.wire[key] += wire

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


class CommStats(Counters):
    """Calls, bytes and seconds of every collective, keyed by "group/kind" (e.g. "tp/all_reduce"), in all
    and by phase."""

    def __init__(self):
        super().__init__()
        self.trace = None            # a mpi_tp.parallel.trace.Trace: every call also becomes an event
        self.phase = OTHER
        self._phases = defaultdict(Counters)
        self._depth = 0              # > 0: inside a timed wait, whose time already counts
        # non-blocking operations started, by key: what only an overlapped schedule does (the tests read
        # it to prove an overlap ran: its numbers equal the blocking order's)
        self.started = defaultdict(int)

    def record(self, key: str, nbytes: int, seconds: float, wire: float = 0.0, timed: bool = True) -> None:
        """Count one call. timed: it has just ended, `seconds` after it began; timed=False: a non-blocking
        operation was started (counted in `started`; its trace event comes when it completes, and
        `seconds` is the start call's own time)."""
        self.add(key, nbytes, wire)
        self._phases[self.phase].add(key, nbytes, wire)
        self._held(key, seconds)
        if not timed:
            self.started[key] += 1
        if self.trace is not None and timed:
            now = time.perf_counter()
            self.trace.complete(key, "comm", now - seconds, now, bytes=int(nbytes))

    def count(self, key: str) -> None:
        """Count one call that moves no bytes of its own and whose time blocked() counted (a wait)."""
        self.add(key, 0, 0.0)
        self._phases[self.phase].add(key, 0, 0.0)

    def _held(self, key: str, seconds: float) -> None:
        if self._depth == 0:         # inside an outer wait, that wait counts the time
            self.seconds[key] += seconds
            self._phases[self.phase].seconds[key] += seconds

    @contextmanager
    def blocked(self, key: str, trace: bool = False):
        """Count the time inside as held in communication under `key` (a non-blocking operation's test,
        wait or start; ring attention's wait for a step's messages), once: waits nested inside add none.
        trace: the interval also becomes a trace event."""
        t0 = time.perf_counter()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            now = time.perf_counter()
            self._held(key, now - t0)
            if trace and self.trace is not None and self._depth == 0:
                self.trace.complete(key, "comm", t0, now)

    @contextmanager
    def in_phase(self, name: str):
        """Count what happens inside as phase `name` (e.g. "train_steps")."""
        before, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = before

    def phases(self) -> dict:
        """{phase: snapshot of what was counted in it}; their sum is snapshot()."""
        return {name: c.snapshot() for name, c in sorted(self._phases.items())}

    def reset(self) -> None:
        super().reset()
        self._phases.clear()
        self.started.clear()


GRAD_KINDS = ("iall_reduce", "reduce_scatter", "zero3_reduce_scatter")   # the reducer's gradient collectives
PARAM_KINDS = ("all_gather", "zero3_gather")                    # ... and its parameters' (ZeRO-1/2 after the
#                                                                 update, ZeRO-3 before each layer runs)
REDUCER_GROUPS = ("dp", "dpcp", "edp")                          # ... and the groups it reduces over


def wire_bytes_by_role(snapshot: dict, reducer=None) -> dict:
    """Wire bytes this rank sent in the counted step (CommStats.snapshot), by role: tensor-parallel
    collectives (the sp/kv gradient sums included), the data-parallel gradient reduction (all-reduce or
    ZeRO's reduce-scatters), ZeRO's parameter all-gathers (ZeRO-1/2: the updated shares; ZeRO-3: each
    layer's, twice a micro-batch), and the rest (the loss's
    and the gradient norm's few bytes, pipeline sends). grad_reduce_dtype: what the buckets reduce in."""
    out = {"tp": 0, "dp_grads": 0, "dp_params": 0, "other": 0}
    for key, v in snapshot.items():
        group, kind = key.split("/", 1)
        role = ("tp" if group == "tp" else "dp_grads" if group in REDUCER_GROUPS and kind in GRAD_KINDS
                else "dp_params" if group in REDUCER_GROUPS and kind in PARAM_KINDS else "other")
        out[role] += v["wire_bytes"]
    if reducer is not None and reducer.buckets:
        out["grad_reduce_dtype"] = str(reducer.buckets[0].grad_dtype)
    return out
