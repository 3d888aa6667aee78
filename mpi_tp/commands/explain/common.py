"""What every `mpi-tp explain` lesson prints about a collective: its kind, calls, buffer bytes and wire bytes.

Buffer bytes (the counters' `bytes`) are the size n of the array handed to the
collective; wire bytes (the counters' `wire_bytes`) are what one rank sends
when the collective runs as a ring over a group of G ranks (docs/notation.md):

    all-reduce                      2 (G-1)/G n
    all-gather, reduce-scatter      (G-1)/G n   (n: the gathered output, the reduced input)
    send                            n
    all-to-all                      the rows that leave the rank (buffer and wire bytes alike)

`wire_bytes` gives these closed forms so that a lesson can set the counted
value beside the formula; `Phases` counts a step's collectives phase by phase
(embedding, blocks, ...) from snapshots of the counters, and marks each phase
in the run's trace as well.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

ALL_REDUCE_KINDS = ("all_reduce", "iall_reduce", "sp_grad_all_reduce", "embedding_all_reduce", "grad_norm",
                    "kv_grad_all_reduce", "routing_sums", "expert_counts", "etp_reduce")
HALF_KINDS = ("all_gather", "all_gather_counts", "regather", "reduce_scatter", "reduce", "routing", "etp_counts",
              "etp_gather")      # (G-1)/G n: half an all-reduce


def wire_bytes(kind: str, n: float, G: int) -> float:
    """The closed form of the wire bytes of one collective of buffer n bytes over G ranks."""
    if G <= 1:
        return 0.0
    if kind in ALL_REDUCE_KINDS:
        return 2 * (G - 1) / G * n
    if kind in HALF_KINDS:
        return (G - 1) / G * n
    if kind in ("send", "all_to_all", "all_to_allv"):
        return float(n)
    return 0.0                                   # a receive (its send counts it), a broadcast (not counted)


def formula_text(kind: str, G: int) -> str:
    """The closed form as text, e.g. "2(G-1)/G n" with G filled in."""
    if kind in ALL_REDUCE_KINDS:
        return f"2({G}-1)/{G} n"
    if kind in HALF_KINDS:
        return f"({G}-1)/{G} n"
    if kind in ("send", "all_to_all", "all_to_allv"):
        return "n"
    return "0 (the sender counts it)" if kind == "recv" else "0 (not counted)"


def comm_text(key: str, v: dict, G: int | None = None) -> str:
    """ "tp/all_reduce: 2 calls, 512 buffer bytes, 512 wire bytes" for one counter entry, and with the
    group's size G the closed form its wire bytes follow (" = 2(2-1)/2 n"; n: the buffer bytes)."""
    form = f" = {formula_text(key.split('/', 1)[1], G)}" if G is not None else ""
    return (f"{key}: {v['calls']} call{'s' * (v['calls'] != 1)}, {v['bytes']} buffer bytes, "
            f"{v['wire_bytes']} wire bytes{form}")


# (pass, kind) -> what the collective is, in Megatron's terms (the tables of tensor_parallel and sequence_parallel)
ROLES = {
    ("forward", "all_reduce"): "g: sum the partial outputs",
    ("backward", "all_reduce"): "f's backward: sum the partial input gradients",
    ("forward", "all_gather"): "sp's f: gather every rank's positions",
    ("backward", "all_gather"): "sp's g backward: gather the output gradient's positions",
    ("forward", "reduce_scatter"): "sp's g: sum the partials, keep this rank's positions",
    ("backward", "reduce_scatter"): "sp's f backward: sum the partial dX, keep this rank's positions",
    ("backward", "regather"): "sp: gather the column layer's kept input shard again, for dA",
    ("backward", "sp_grad_all_reduce"): "sum replicated parameters' gradients over the positions",
    ("backward", "kv_grad_all_reduce"): "sum a replicated key/value head's gradients over its holders",
}


def phase_lines(phase: str, snapshot: dict, T: int, sizes: dict | None = None) -> list[str]:
    """The tensor-parallel layers' collectives of one pass, one line each, with their role (ROLES).
    sizes: the size of each group other than tp, by name (e.g. "kv", the ranks holding a key/value head)."""
    if not snapshot:
        return [f"  {phase:<9} none" + (" (one rank: nothing to communicate)" if T == 1 else "")]
    size = lambda key: (sizes or {}).get(key.split("/", 1)[0], T)
    return [f"  {phase:<9} {comm_text(key, v, size(key))}  ({ROLES.get((phase, key.split('/', 1)[1]), '')})"
            for key, v in snapshot.items()]


class Phases:
    """Counts of every collective, attributed to the innermost open phase (or to `outside`).

        phases = Phases(topo.stats)
        with phases("embedding"): ...          # what the counters gained in here goes to "embedding"
        phases.counts  ->  {phase: {key: {"calls", "bytes", "wire_bytes"}}}

    A collective is attributed when it starts (a non-blocking all-reduce started
    during the backward pass belongs to the backward pass). With `stats.trace` set,
    each phase also becomes a span of category "phase" in the trace.
    """

    def __init__(self, stats, outside: str = "between phases"):
        self.stats, self.stack, self.order, self.outside = stats, [], [], outside
        self.counts = defaultdict(lambda: defaultdict(lambda: {"calls": 0, "bytes": 0, "wire": 0.0}))
        self._last = self._now()

    def _now(self) -> tuple:
        s = self.stats
        return dict(s.calls), dict(s.bytes), dict(s.wire)

    def _flush(self) -> None:
        now = self._now()
        phase = self.stack[-1] if self.stack else self.outside
        for key, calls in now[0].items():
            d = calls - self._last[0].get(key, 0)
            if d:
                c = self.counts[phase][key]
                c["calls"] += d
                c["bytes"] += now[1][key] - self._last[1].get(key, 0)
                c["wire"] += now[2][key] - self._last[2].get(key, 0.0)
                if phase not in self.order:
                    self.order.append(phase)
        self._last = now

    @contextmanager
    def __call__(self, name: str):
        self._flush()
        trace = self.stats.trace if name not in self.stack else None   # a phase inside itself: one span
        self.stack.append(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._flush()
            self.stack.pop()
            if trace is not None:
                trace.complete(name, "phase", start, time.perf_counter())

    def wrap(self, obj, method: str, name: str) -> None:
        """obj.method runs inside phase `name` from now on (an attribute of this instance only)."""
        inner = getattr(obj, method)

        def wrapped(*a, **kw):
            with self(name):
                return inner(*a, **kw)
        setattr(obj, method, wrapped)

    def snapshot(self, phase: str) -> dict:
        """{key: {"calls", "bytes", "wire_bytes"}} of one phase, as CommStats.snapshot() gives them."""
        return {k: {"calls": v["calls"], "bytes": v["bytes"], "wire_bytes": round(v["wire"])}
                for k, v in sorted(self.counts.get(phase, {}).items())}
