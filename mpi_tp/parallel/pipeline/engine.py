"""The pipeline engine: runs one stage's action list, moving activations and gradients between stages.

    engine = PipelineEngine(group, actions, chunks=v)            # group: this rank's pipeline group
    engine.run(forward, backward, message_shape, dtype)

`forward(m, c, x)` runs micro-batch m through local chunk c (x: the previous
chunk's output, or None for the model's first chunk) and returns its output
(None for the model's last chunk, which computed the loss). `backward(m, c, dy)`
runs its backward (dy None for the last chunk) and returns the gradient of its
input (None for the first chunk). The engine knows nothing of the model: it
executes the schedule (mpi_tp.parallel.pipeline.schedules) and does the
point-to-point communication.

Messages have a shape agreed in advance (one micro-batch's activations, the
same for gradients), so nothing but the data is exchanged: a receive is posted
into a preallocated buffer when its action comes, then waited on; a send starts
as soon as its data exists and completes in the background (its buffer is not
touched again). Tags say which (micro-batch, chunk, direction) a message is,
so messages in flight at once cannot be confused. Because the schedule is
valid (every stage can always make progress: schedules.simulate proves it),
these blocking receives cannot deadlock.
"""
from __future__ import annotations

from mpi4py import MPI

from mpi_tp.core import backend
from mpi_tp.core.errors import UserError
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.pipeline.schedules import Action, global_chunk
from mpi_tp.parallel.trace import span

ACTIVATION, GRADIENT = 0, 1


class PipelineEngine:
    """One stage of the pipeline group `group`, running `actions` over its `chunks` model chunks."""

    def __init__(self, group: Group, actions: list[Action], chunks: int = 1):
        self.group, self.actions, self.v = group, actions, chunks
        self.P, self.s = group.size, group.rank
        self.last = self.P * chunks - 1                     # the model's last chunk, globally
        micro = 1 + max((a.micro for a in actions), default=0)
        top = (micro * (self.last + 1)) * 2
        limit = group.comm.Get_attr(MPI.TAG_UB) if group.size > 1 else top
        if top > limit:
            raise UserError(f"{micro} micro-batches x {self.last + 1} chunks need message tags up to {top}, "
                            f"above this MPI's limit {limit}: use fewer micro-batches or chunks")

    def _tag(self, micro: int, g: int, kind: int) -> int:
        return (micro * (self.last + 1) + g) * 2 + kind

    def run(self, forward, backward, shape, dtype, actions: list[Action] | None = None) -> None:
        """Execute the action list once (one training step's forwards and backwards), or `actions`
        instead (forward_only's list for evaluation)."""
        xp = backend.xp()
        sends = []
        for a in self.actions if actions is None else actions:
            g = global_chunk(self.s, a.chunk, self.P)
            if a.kind == "F":
                x = None
                if g > 0:                                    # the previous chunk's output, from the stage before
                    x = xp.empty(shape, dtype)
                    self.group.irecv(x, (g - 1) % self.P, self._tag(a.micro, g, ACTIVATION)).wait()
                with span(self.group.stats.trace, "F", "pipeline", micro=a.micro, chunk=g):
                    y = forward(a.micro, a.chunk, x)
                if g < self.last:
                    sends.append(self.group.isend(y, (g + 1) % self.P, self._tag(a.micro, g + 1, ACTIVATION)))
            else:
                dy = None
                if g < self.last:                            # the next chunk's input gradient, from the stage after
                    dy = xp.empty(shape, dtype)
                    self.group.irecv(dy, (g + 1) % self.P, self._tag(a.micro, g, GRADIENT)).wait()
                with span(self.group.stats.trace, "B", "pipeline", micro=a.micro, chunk=g):
                    dx = backward(a.micro, a.chunk, dy)
                if g > 0:
                    sends.append(self.group.isend(xp.ascontiguousarray(dx), (g - 1) % self.P,
                                                  self._tag(a.micro, g - 1, GRADIENT)))
            sends = [p for p in sends if not p.test()]       # let finished sends go, drive progress
        for p in sends:
            p.wait()

    def forward_only(self, micro_batches: int) -> list[Action]:
        """The forwards alone, micro-batch by micro-batch, chunk by chunk (evaluation, sampling)."""
        return [Action("F", m, c) for m in range(micro_batches) for c in range(self.v)]
