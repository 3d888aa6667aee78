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
gathered and reduced together. Only a GPT not cut into pipeline stages runs
it (the training configuration refuses --pp with what to use instead).
"""
from __future__ import annotations

import contextlib

from mpi_tp.core import backend


class FSDP:
    """The ZeRO-3 gathers and reductions of one model's buckets (a GradReducer's, stage 3); set on the
    model as model.fsdp by the reducer."""

    def __init__(self, model, reducer):
        if not hasattr(model, "hidden"):
            raise ValueError("ZeRO-3 runs a model that is not cut into pipeline stages (use ZeRO-2 with pipelines)")
        self.reducer, self.buckets = reducer, reducer.buckets
        self.of_block = {}           # block -> its buckets: its dense one, and its experts' (over edp) if any
        for k, b in enumerate(self.buckets):
            for i in b.blocks:
                self.of_block[i] = self.of_block.get(i, ()) + (k,)
        self.outer = tuple(k for k, b in enumerate(self.buckets) if not b.blocks)
        self.n_blocks, self.first, self.last = len(model.h), model.first, model.last
        self._flight = {}            # bucket -> (whole buffer, Pending): gathers started, not yet waited for
        self._reducing = []          # [(bucket, Pending, what to add to its share or None)], in start order
        self._fresh = set(range(len(self.buckets)))     # shares this step's first reduction writes directly
        self._fwd = self._bwd = ()                       # the buckets the last forward / backward piece used
        self.ahead = 0               # gathers a piece found started by the call before it (the overlap's count)
        model.fsdp = self

    def _buckets(self, piece) -> tuple:
        """The buckets of a piece: a block index, "embedding" or "head" (none: this chunk has no such piece,
        or piece is None)."""
        if piece is None:
            return ()
        if piece == "embedding":
            return self.outer if self.first else ()
        if piece == "head":
            return self.outer if self.last else ()
        return self.of_block.get(piece, ())

    def _after(self, piece, forward: bool):
        """The piece that runs next in this pass (None: piece is its last)."""
        order = ["embedding", *range(self.n_blocks), "head"]
        if not forward:
            order.reverse()
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

    def forward(self, piece) -> None:
        """Before the piece's forward (a block index, "embedding"; "head" after the last block)."""
        ks = self._buckets(piece)
        for k in self._fwd:
            if k not in ks:
                self.buckets[k].drop_params()
        for k in ks:
            self._ready(k)
        self._fwd = ks
        self._gather(self._buckets(self._after(piece, forward=True)))     # flies while this piece computes
        self._progress()

    def backward(self, piece) -> None:
        """Before the piece's backward ("head", a block index, "embedding"); "end" after the last one."""
        if piece == "end":
            for k, b in enumerate(self.buckets):
                if b.grads is not None:
                    self._reduce(k)
                b.drop_params()
            self._fwd = self._bwd = ()
            self._progress()
            return
        ks = self._buckets(piece)
        for k in self._bwd:
            if k not in ks and k not in self.outer:                     # the outer buckets: until "end"
                self._reduce(k)
                self.buckets[k].drop_params()
        for k in ks:
            self._ready(k)
            self.buckets[k].hold_grads()
        self._bwd = ks or self._bwd
        self._gather(self._buckets(self._after(piece, forward=False)))
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
