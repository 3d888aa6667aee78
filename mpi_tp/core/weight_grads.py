"""B and W: a backward pass's input gradients now, its weights' gradients now or later.

A layer's backward does two things. It computes the gradient of its input
(B), which the layer below waits for and, in a pipeline, the previous stage
too: the critical path. And it computes its weights' gradients (W), which
nothing else in the backward pass reads. Zero-bubble pipelines (Qi et al.
2024) run W later, in what would otherwise be the bubble
(mpi_tp.parallel.pipeline.schedules: "zb-h1", "zb-v").

Every layer therefore computes B itself and hands W over:

    dx = linear_backward_input(dout, w)                 # B: returned to the layer below
    weight_grad(self._weights_grad, dout, x)            # W: self._weights_grad(dout, x), now or later

Outside `deferring` (every schedule but the zero-bubble ones), weight_grad
runs the function at once: the backward pass computes what it computed before,
in the same order per parameter. Inside `deferring(work)` it appends the call
to `work`, a WeightWork, which keeps the arrays the call needs alive until the
schedule's W action runs `work.run()`: the memory W costs while it waits,
`held_bytes()`, counted by the pipeline stage. Calls run in the order they
were made, so each parameter's gradient adds its contributions in the same
order either way.

A W function may communicate (under sequence parallelism the column layers
all-gather their input again in W, not in B): every rank of a tensor-parallel
group runs the same action list, so they reach each W's collectives together.
"""
from __future__ import annotations

import contextlib

from mpi_tp.core import memory

_collecting = None            # the WeightWork that weight_grad appends to, or None: run at once


def weight_grad(fn, *args) -> None:
    """fn(*args) now, or, inside `deferring(work)`, at work.run() (args kept alive until then)."""
    if _collecting is None:
        fn(*args)
    else:
        _collecting.items.append((fn, args))


def deferring_now() -> bool:
    """Whether weight_grad defers (a layer that overlaps W with B's communication cannot then)."""
    return _collecting is not None


class WeightWork:
    """The W of one (micro-batch, chunk): the weight-gradient calls its backward deferred, in order."""

    def __init__(self):
        self.items: list = []

    def __len__(self) -> int:
        return len(self.items)

    def run(self) -> None:
        """Make every deferred call, in order, and let go of what they kept."""
        items, self.items = self.items, []
        for fn, args in items:
            fn(*args)

    def arrays(self):
        """Every array the deferred calls keep alive (their arguments, nested ones too)."""
        for _, args in self.items:
            yield from memory.arrays_in(args)

    def held_bytes(self) -> int:
        """Bytes of the arrays the deferred calls keep alive (each owning array once)."""
        owners = {id(a): a for a in map(memory.owner, self.arrays())}
        return sum(int(a.nbytes) for a in owners.values())


@contextlib.contextmanager
def deferring(work: WeightWork):
    """Inside, weight_grad appends to `work` instead of running (a zero-bubble schedule's B action)."""
    global _collecting
    if _collecting is not None:
        raise RuntimeError("weight gradients are already being deferred: B actions do not nest")
    _collecting = work
    try:
        yield work
    finally:
        _collecting = None
