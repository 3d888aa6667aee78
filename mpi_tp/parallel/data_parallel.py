"""Data parallelism: average the gradients over the replicas, in buckets, during the backward pass.

Each of the D replicas (one per position in the data-parallel group, see
Topology) holds the same shards and computes gradients on its own part of the
global batch; the mean of their gradients is the gradient of the global batch.

The gradients live in a few contiguous buckets (every parameter's gradient is a
view into one), so that a bucket is one `Iallreduce` with no packing. Buckets
are cut at block boundaries, last block first: as soon as the backward pass has
finished the blocks of a bucket, its all-reduce starts, and it proceeds while
the earlier blocks compute (Megatron's and PyTorch DDP's overlap). The
embedding tables and the final LayerNorm, whose gradients are final only when
the backward pass ends, form the last bucket.

Without a spare core, MPI progresses a non-blocking collective only when the
process calls into MPI; `block_done` therefore also tests the outstanding
requests. `overlap=False` does every all-reduce after the backward pass, for
comparison. `hierarchical=True` reduces each bucket node by node
(mpi_tp.parallel.hierarchical), after the backward pass.
"""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.core.params import storages
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.hierarchical import HierarchicalAllReduce


class GradReducer:
    """Averages gradients over `group` (the data-parallel group); hook it into GPT.backward."""

    def __init__(self, model, group: Group, bucket_mb: float = 8.0, overlap: bool = True,
                 hierarchical: bool = False):
        self.group, self.overlap = group, overlap and not hierarchical
        self.hierarchical = HierarchicalAllReduce(group) if hierarchical and group.size > 1 else None
        self.buckets = []          # [(flat grad buffer, index of the block that completes it or None)]
        self._pending = []
        if group.size == 1:
            return
        # Which block each parameter storage belongs to (None: embeddings and ln_f, ready at the end).
        owner = {}
        for i, block in enumerate(model.h):
            for p in block.parameters():
                owner[id(p.base)] = i
        stores = storages(model.parameters())
        limit = bucket_mb * 2**20
        current, size = [], 0
        for i in reversed(range(len(model.h))):            # backward order
            for store in stores:
                if owner.get(id(store[0])) == i:
                    current.append(store)
                    size += store[0].nbytes
            if size >= limit or i == 0:
                if current:
                    self._make_bucket(current, i)
                current, size = [], 0
        rest = [s for s in stores if id(s[0]) not in owner]
        if rest:
            self._make_bucket(rest, None)

    def _make_bucket(self, stores, ready_after) -> None:
        """One flat gradient buffer for these storages; their Params' grads become views into it."""
        xp = backend.xp()
        n = sum(base.size for base, _, _ in stores)
        flat = xp.zeros(n, dtype=stores[0][0].dtype)
        at = 0
        for base, grad, members in stores:
            view = flat[at:at + base.size].reshape(base.shape)
            view[...] = grad
            for p in members:
                p.grad_base, p.grad = view, view[p.view]
            at += base.size
        self.buckets.append((flat, ready_after))

    def block_done(self, i: int) -> None:
        """Called by the backward pass after block i: start the buckets it completes."""
        if not self.overlap:
            return
        for flat, ready_after in self.buckets:
            if ready_after == i:
                self._pending.append((self.group.iall_reduce(flat), flat))
        for pending, _ in self._pending:
            pending.test()                                  # drive MPI's progress engine

    def finish(self) -> None:
        """After the backward pass: reduce what is left, wait for everything, divide by D."""
        if self.group.size == 1:
            return
        if self.hierarchical is not None:
            for flat, _ in self.buckets:
                self.hierarchical.all_reduce(flat)
                flat *= 1.0 / self.group.size
            return
        started = {id(flat) for _, flat in self._pending}
        for flat, _ in self.buckets:
            if id(flat) not in started:
                self._pending.append((self.group.iall_reduce(flat), flat))
        for pending, flat in self._pending:
            pending.wait()
            flat *= 1.0 / self.group.size
        self._pending = []
