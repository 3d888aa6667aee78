"""The pipeline engine: runs one stage's action list, moving activations and gradients between stages.

    engine = PipelineEngine(group, actions, chunks=v)            # group: this rank's pipeline group
    engine.run(forward, backward, message_shape, dtype)
    engine.run(forward, backward, message_shape, dtype, weights=weights)   # a zero-bubble list (W actions)
    PipelineEngine(group, actions, v, prepost=0)                 # no receive posted ahead (the old engine)

`forward(m, c, x)` runs micro-batch m through local chunk c (x: the previous
chunk's output, or None for the model's first chunk) and returns its output
(None for the model's last chunk, which computed the loss). `backward(m, c, dy)`
runs its backward (dy None for the last chunk) and returns the gradient of its
input (None for the first chunk). `weights(m, c)` runs a W action: the weights'
gradients that micro-batch m's backward through chunk c deferred (zero-bubble
lists only; no message). The engine knows nothing of the model: it executes
the schedule (mpi_tp.parallel.pipeline.schedules) and does the point-to-point
communication. Under the V placement (v_shape, zb-v) the rank holding chunk
P - 1 also holds chunk P: that activation and its gradient are handed over in
memory, not sent.

Messages have a shape agreed in advance (one micro-batch's activations, the
same for gradients), so nothing but the data is exchanged. Tags say which
(micro-batch, chunk, direction) a message is, so messages in flight at once
cannot be confused. A send starts (Isend) as soon as its data exists and
completes in the background (its buffer is not touched again).

Receives are posted ahead, as Megatron posts the next receive together with
the current send (its batched isend/irecv): before action k computes, the
receives of actions k, k + 1, ..., k + prepost are posted (Irecv), each into
a buffer of its own allocated then, so a neighbour's message can arrive while
this stage computes action k; action k then waits only for its own. With
prepost = 0 a receive is posted when its action starts and waited at once,
every hop's transfer on the critical path (the comparison kept for
experiments/vs_torch/pipeline_vs_torch.py; MPI_TP_PIPE_PREPOST sets the default, 2).
Buffers are not recycled: forward and backward may keep what they are given
(a chunk caches its input for its backward). Between actions the engine tests
its outstanding sends and receives: MPICH moves data only inside MPI calls
(no progress thread), and a test is such a call.

Why this cannot deadlock. The only blocking calls are the wait on action k's
own receive, just before action k computes, and the waits on the sends after
the last action. Those are the same waits, at the same points of the action
list, as with nothing posted ahead, and every send is still started right
after the compute that produced it. Posting a receive earlier only lets a
message land sooner: a receive never blocks a send, and a posted receive can
match only its own message (its source and tag are unique in the step). So
the argument of the blocking engine stands: the schedule is valid (every
stage can always make progress: schedules.simulate proves it), so every
awaited message is eventually sent. Every posted receive belongs to an action
of the list, so a run that returns leaves none behind; one that raises
cancels those it posted, so they cannot catch a later run's messages.
"""
from __future__ import annotations

import os
import time

from mpi_tp.core import backend, memory
from mpi_tp.core.errors import UserError
from mpi_tp.parallel.collectives import Group, tag_limit
from mpi_tp.parallel.pipeline.actions import Action, chunk_owner, global_chunk
from mpi_tp.parallel.trace import span

ACTIVATION, GRADIENT = 0, 1
PREPOST = 2             # receives posted ahead of the current action, unless MPI_TP_PIPE_PREPOST says otherwise


def default_prepost() -> int:
    """MPI_TP_PIPE_PREPOST (a count of actions, 0: none posted ahead), else PREPOST."""
    text = os.environ.get("MPI_TP_PIPE_PREPOST", "")
    if not text:
        return PREPOST
    if not text.isdigit():
        raise UserError(f"MPI_TP_PIPE_PREPOST={text!r}: give how many actions ahead to post receives (0, 1, 2 ...)")
    return int(text)


class PipelineEngine:
    """One stage of the pipeline group `group`, running `actions` over its `chunks` model chunks,
    with the receives of the next `prepost` actions posted before each action computes.

    posts: after a run, (k, j) for each receive posted: action k's receive, posted just before
    action j computed (j < k when posted ahead). Tests read it; it costs a tuple per message.
    waited: after a run, the seconds it spent blocked in receives (waiting for a neighbour's
    message, or for its transfer to finish): what posting ahead can shorten.
    """

    def __init__(self, group: Group, actions: list[Action], chunks: int = 1, prepost: int | None = None,
                 v_shape: bool = False):
        self.group, self.actions, self.v, self.v_shape = group, actions, chunks, v_shape
        self.P, self.s = group.size, group.rank
        self.prepost = default_prepost() if prepost is None else prepost
        if self.prepost < 0:
            raise UserError(f"prepost={self.prepost}: receives can be posted 0 or more actions ahead")
        self.posts: list[tuple[int, int]] = []
        self.waited = 0.0
        self.last = self.P * chunks - 1                     # the model's last chunk, globally
        micro = 1 + max((a.micro for a in actions), default=0)
        top = (micro * (self.last + 1)) * 2
        limit = tag_limit() if group.size > 1 else top
        if top > limit:
            raise UserError(f"{micro} micro-batches x {self.last + 1} chunks need message tags up to {top}, "
                            f"above this MPI's limit {limit}: use fewer micro-batches or chunks")

    def _tag(self, micro: int, g: int, kind: int) -> int:
        return (micro * (self.last + 1) + g) * 2 + kind

    def _chunk(self, a: Action) -> int:
        return global_chunk(self.s, a.chunk, self.P, self.v_shape)

    def _owner(self, g: int) -> int:
        return chunk_owner(g, self.P, self.v_shape)

    def _receive(self, a: Action) -> tuple[int, int] | None:
        """(source rank, tag) of the message action `a` needs, or None (the model's first chunk's
        forward, its last chunk's backward, a W)."""
        g = self._chunk(a)
        if a.kind == "F":                                    # the previous chunk's output, from the stage before
            return (self._owner(g - 1), self._tag(a.micro, g, ACTIVATION)) if g > 0 else None
        if a.kind == "B":
            return (self._owner(g + 1), self._tag(a.micro, g, GRADIENT)) if g < self.last else None
        return None

    def _send(self, sends: list, local: dict, data, g: int, tag: int) -> None:
        """Start sending `data` to the rank holding chunk g, or hand it over here when that is this rank."""
        if self._owner(g) == self.s:
            local[tag] = data
        else:
            sends.append(self.group.isend(data, self._owner(g), tag))

    def run(self, forward, backward, shape, dtype, actions: list[Action] | None = None, weights=None) -> None:
        """Execute the action list once (one training step's forwards and backwards), or `actions`
        instead (forward_only's list for evaluation). weights: runs the W actions (needed if any)."""
        xp = backend.xp()
        acts = self.actions if actions is None else actions
        if weights is None and any(a.kind == "W" for a in acts):
            raise ValueError("this action list has W actions: give run() the weights callback")
        needs = [self._receive(a) for a in acts]
        for k, need in enumerate(needs):                     # handed over in memory, not received
            if need is not None and need[0] == self.s:
                needs[k] = ("here", need[1])
        sends, posted, ahead, local = [], {}, 0, {}          # posted: action index -> its pending receive
        self.posts, self.waited = [], 0.0
        try:
            for k, a in enumerate(acts):
                while ahead < len(acts) and ahead <= k + self.prepost:   # receives of actions k .. k + prepost
                    if needs[ahead] is not None and needs[ahead][0] != "here":
                        posted[ahead] = self.group.irecv(xp.empty(shape, dtype), *needs[ahead])
                        self.posts.append((ahead, k))
                    ahead += 1
                inp = None
                if k in posted:
                    t0 = time.perf_counter()
                    inp = posted.pop(k).wait()
                    self.waited += time.perf_counter() - t0
                elif needs[k] is not None:
                    inp = local.pop(needs[k][1])
                g = self._chunk(a)
                if a.kind == "F":
                    with span(self.group.stats.trace, "F", "pipeline", micro=a.micro, chunk=g):
                        y = forward(a.micro, a.chunk, inp)
                    if g < self.last:
                        self._send(sends, local, y, g + 1, self._tag(a.micro, g + 1, ACTIVATION))
                elif a.kind == "B":
                    with span(self.group.stats.trace, "B", "pipeline", micro=a.micro, chunk=g):
                        dx = backward(a.micro, a.chunk, inp)
                    if g > 0:
                        self._send(sends, local, xp.ascontiguousarray(dx), g - 1, self._tag(a.micro, g - 1, GRADIENT))
                else:
                    with span(self.group.stats.trace, "W", "pipeline", micro=a.micro, chunk=g):
                        weights(a.micro, a.chunk)
                sends = [p for p in sends if not p.test()]   # let finished sends go, drive progress
                for p in posted.values():                    # and move the data of receives posted ahead
                    p.test()
                memory.probe(a.kind, [*posted.values(), *sends])   # mpi_tp.core.memory, when a meter samples
            for p in sends:
                p.wait()
        except BaseException:
            for p in posted.values():
                p.cancel()
            raise

    def forward_only(self, micro_batches: int) -> list[Action]:
        """The forwards alone, micro-batch by micro-batch, chunk by chunk (evaluation, sampling)."""
        return [Action("F", m, c) for m in range(micro_batches) for c in range(self.v)]
