"""ZeRO-3 (fully sharded data parallelism, FSDP): each layer's parameters gathered just before it runs.

With --zero 3 every rank keeps only its share of each bucket's flat parameters
(mpi_tp.parallel.buckets: one block a bucket, the embedding and the head
together in one more, since they share the tied table wte). The model calls
its FSDP at each piece (GPT.hidden and GPT.backward):

    forward:   fsdp.forward("embedding"), embedding, fsdp.forward(0), block 0, ..., fsdp.forward("head")
    backward:  fsdp.backward("head"), head, fsdp.backward(L-1), block L-1, ..., fsdp.backward("embedding"),
               embedding, fsdp.backward("end")

At each call the piece's parameters are made whole (an all-gather over the
data-parallel group, `dp/zero3_gather`, started one piece ahead, so it flies
while the piece before computes), the previous piece's are let go, and in the
backward pass the previous piece's gradients, held only while its backward
ran, are reduce-scattered into this rank's share (`dp/zero3_reduce_scatter`,
after every micro-batch) and let go: a block's whole gradients live while its
backward runs, the embedding's and head's from the head's backward to the
embedding's. The embedding's and head's bucket is gathered before the
embedding's forward, let go, gathered again before the head's forward and
kept until the embedding's backward is done (the head's backward follows its
forward at once). So per micro-batch every parameter is gathered twice and
its gradient reduce-scattered once: 3 transfers of the model where ZeRO-1 and
2 make 2 per step (the reduce-scatter and the updated parameters' all-gather),
1.5x their data-parallel bytes (Rajbhandari et al. 2020, section 7.2.3). The
optimizer updates the shares in place; nothing is gathered after it.

Experts: a mixture-of-experts block has two buckets, its dense parameters'
(over dp) and its experts' (over edp, the replicas holding the same experts),
gathered and reduced together.

Pipelines: the reducer's model is the stage; each of its chunks (a GPT over
some of the blocks) calls a ChunkFSDP, which names its pieces for the stage
(block i of chunk j is the stage's block offset_j + i). A schedule's forward
and backward actions are each one pass over one chunk, so the same rules
hold whatever the order of the actions: a backward ends with "end", which
reduces what it held and lets every piece go. A stage's copy of the tied
table wte is a bucket of its own, summed with the other copies as shares
after the step's reductions (mpi_tp.parallel.finalize). Under the
zero-bubble schedules a piece's gradients are written at its W, after its
backward: its reduce-scatter waits for that W (mpi_tp.core.weight_grads),
and, while other micro-batches' W's still write into the same whole
gradients, for the last of them (a count per bucket).
"""
from __future__ import annotations

import contextlib

from mpi_tp.core import backend
from mpi_tp.core.weight_grads import weight_grad


class FSDP:
    """The ZeRO-3 gathers and reductions of one model's buckets (a GradReducer's, stage 3); set on the
    model as model.fsdp by the reducer."""

    def __init__(self, model, reducer):
        self.reducer, self.buckets = reducer, reducer.buckets
        self.of_block = {}           # block -> its buckets: its dense one, and its experts' (over edp) if any
        for k, b in enumerate(self.buckets):
            for i in b.blocks:
                self.of_block[i] = self.of_block.get(i, ()) + (k,)
        self.outer = tuple(k for k, b in enumerate(self.buckets) if not b.blocks)
        chunks = getattr(model, "chunks", [model])                   # a pipeline stage's, or the model
        self.offsets = getattr(model, "block_offsets", [0])
        self.order = [["embedding", *range(len(c.h)), "head"] for c in chunks]    # each chunk's pieces
        self.ends = [{"embedding": self._holding(c.embedding.parameters()) if c.first else (),
                      "head": self._holding(c.head.parameters()) if c.last else ()} for c in chunks]
        self._flight = {}            # bucket -> (whole buffer, Pending): gathers started, not yet waited for
        self._reducing = []          # [(bucket, Pending, what to add to its share or None)], in start order
        self._fresh = set(range(len(self.buckets)))     # shares this step's first reduction writes directly
        self._writers = {}           # bucket -> backward passes whose W has yet to write its whole gradients
        self._held = []              # the buckets this backward pass holds the gradients of, not yet released
        self._fwd = self._bwd = ()                       # the buckets the last forward / backward piece used
        self.ahead = 0               # gathers a piece found started by the call before it (the overlap's count)
        model.fsdp = self
        if chunks[0] is not model:                                    # a stage: each chunk its view
            for j, c in enumerate(chunks):
                c.fsdp = ChunkFSDP(self, j)

    def _holding(self, params) -> tuple:
        """The outer buckets (no block's) holding any of these parameters."""
        ids = {id(p) for p in params}
        return tuple(k for k in self.outer if any(id(p) in ids for _, _, ps in self.buckets[k].stores for p in ps))

    def _buckets(self, piece, j: int) -> tuple:
        """The buckets of chunk j's piece: a block index of the chunk, "embedding" or "head" (none: the chunk
        has no such piece, or piece is None)."""
        if piece is None:
            return ()
        if piece in ("embedding", "head"):
            return self.ends[j][piece]
        return self.of_block.get(self.offsets[j] + piece, ())

    def _after(self, piece, forward: bool, j: int):
        """The piece of chunk j that runs next in this pass (None: piece is its last)."""
        order = self.order[j] if forward else self.order[j][::-1]
        at = order.index(piece)
        return order[at + 1] if at + 1 < len(order) else None

    def _gather(self, ks: tuple) -> None:
        for k in ks:
            self._gather_one(k)

    def _gather_one(self, k) -> None:
        """Start making bucket k whole (nothing when it is, or on its way)."""
        if k in self._flight or self.buckets[k].params is not None:
            return
        b = self.buckets[k]
        full = backend.xp().empty(b.size, b.param_share.dtype)       # (n,) whole, this rank's share in place
        full[b.share] = b.param_share
        self._flight[k] = full, b.group.iall_gather_inplace(full, b.shares, kind="zero3_gather")

    def _ready(self, k) -> None:
        """Bucket k whole now: its members' data are views of it."""
        if k in self._flight:
            self.ahead += 1
        self._gather_one(k)
        self._wait(k)

    def _wait(self, k) -> None:
        if k in self._flight:
            full, pending = self._flight.pop(k)
            pending.wait()
            self.buckets[k].hold_params(full)

    def _reduce(self, k) -> None:
        """Start reducing bucket k's whole gradients into this rank's share; let them go."""
        b = self.buckets[k]
        self.reducer.sum_over_tp(b)                                   # sequence-parallel, key/value replicas
        fresh = k in self._fresh
        self._fresh.discard(k)
        out = b.grad_share if fresh else backend.xp().empty_like(b.grad_share)
        if b.group.size == 1:                 # an expert held by one replica (ep = D): nothing to sum
            out[...] = b.grads
            pending = None
        else:
            pending = b.group.ireduce_scatter(b.grads, b.shares, axis=0, out=out, kind="zero3_reduce_scatter")
        self._reducing.append((k, pending, None if fresh else out))
        b.drop_grads()                                                # the Pending keeps them until sent

    def _release(self, k) -> None:
        """This backward pass is done with bucket k: reduce it once the pass's W has written its gradients
        (at once, or at a zero-bubble schedule's W action) and no other pass's W still will."""
        self._held.remove(k)
        self._writers[k] = self._writers.get(k, 0) + 1
        weight_grad(self._written, k)

    def _written(self, k) -> None:
        self._writers[k] -= 1
        if self._writers[k] == 0:
            self._reduce(k)

    def _progress(self, wait: bool = False) -> None:
        """Add the finished reductions to their shares, in start order (an earlier one writes the share)."""
        while self._reducing:
            k, pending, add = self._reducing[0]
            if pending is not None and wait:
                pending.wait()
            elif pending is not None and not pending.test():
                break
            if add is not None:
                self.buckets[k].grad_share += add
            self._reducing.pop(0)
        for _, pending in self._flight.values():
            pending.test()                                            # drive MPI's progress engine

    def forward(self, piece, j: int = 0) -> None:
        """Before the piece's forward (a block index, "embedding"; "head" after the last block) in chunk j."""
        ks = self._buckets(piece, j)
        for k in self._fwd:
            if k not in ks:
                self.buckets[k].drop_params()
        for k in ks:
            self._ready(k)
        self._fwd = ks
        self._gather(self._buckets(self._after(piece, True, j), j))        # flies while this piece computes
        self._progress()

    def backward(self, piece, j: int = 0) -> None:
        """Before the piece's backward ("head", a block index, "embedding") in chunk j; "end" after the last."""
        if piece == "end":
            for k in list(self._held):
                self._release(k)
            for b in self.buckets:
                b.drop_params()
            self._fwd = self._bwd = ()
            self._progress()
            return
        ks = self._buckets(piece, j)
        for k in self._bwd:
            if k not in ks and k not in self.outer and k in self._held:     # the outer buckets: until "end"
                self._release(k)
                self.buckets[k].drop_params()
        for k in ks:
            self._ready(k)
            self.buckets[k].hold_grads()
            if k not in self._held:
                self._held.append(k)
        self._bwd = ks or self._bwd
        self._gather(self._buckets(self._after(piece, False, j), j))
        self._progress()

    def finish(self) -> None:
        """After the step's last backward: every reduction in, the shares averaged over the group, every
        gather waited for and let go (the update changes the shares: a whole copy would be stale)."""
        self._progress(wait=True)
        self.settle()
        for k, b in enumerate(self.buckets):
            if k in self._fresh:                                     # no backward reached it this step
                b.grad_share[...] = 0
            b.grad_share *= 1.0 / self.reducer.group.size
        self._fresh = set(range(len(self.buckets)))

    def settle(self) -> None:
        """No gather in flight, no bucket whole."""
        for _, pending in self._flight.values():
            pending.wait()
        self._flight = {}
        for b in self.buckets:
            b.drop_params()
        self._fwd = self._bwd = ()


class ChunkFSDP:
    """What chunk j of a pipeline stage calls as its fsdp: the stage's FSDP, told which chunk."""

    def __init__(self, fsdp: FSDP, j: int):
        self.fsdp, self.j = fsdp, j

    def forward(self, piece) -> None:
        self.fsdp.forward(piece, self.j)

    def backward(self, piece) -> None:
        self.fsdp.backward(piece, self.j)


class Whole:
    """A model whose parameters are whole on every rank (no ZeRO-3): nothing to gather, nothing to reduce."""

    def forward(self, piece) -> None:
        pass

    def backward(self, piece) -> None:
        pass


WHOLE = Whole()


@contextlib.contextmanager
def whole_params(model):
    """Every parameter whole on this rank inside (a checkpoint's save and load, a test's comparison):
    collective over the data-parallel group under ZeRO-3, nothing otherwise. Values written inside are
    kept: each rank takes its share back on the way out."""
    fsdp = getattr(model, "fsdp", WHOLE)
    if not isinstance(fsdp, FSDP):
        yield model
        return
    fsdp.settle()
    fsdp._gather(tuple(range(len(fsdp.buckets))))
    for k in range(len(fsdp.buckets)):
        fsdp._wait(k)
    try:
        yield model
    finally:
        for b in fsdp.buckets:
            b.param_share[...] = b.params[b.share]
        fsdp.settle()
