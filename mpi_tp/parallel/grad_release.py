"""ZeRO-2: a bucket's whole gradient buffer held only while the backward pass needs it.

Under the distributed optimizer (--zero 1) a rank keeps every bucket's whole gradient buffer for
the whole step, though after the reduce-scatter it reads only its share (Bucket.grad_share).
ZeRO-2 (Rajbhandari et al. 2020, stage 2; --zero 2) lets a bucket's buffer go as soon as its
reduce-scatter is done, and makes it again, zeroed, when the next backward pass first reaches one
of the bucket's blocks (the embeddings' and ln_f's bucket: the head's or the embedding's
backward). Between the two the rank holds its 1/D share of those gradients: during the forward
passes, the optimizer step, and, with one micro-batch, behind the backward pass as it moves down
the blocks. The collectives, their bytes and the numbers are ZeRO-1's exactly (the same buffers
reduce-scattered, their shares updated); only when the buffers exist changes. With M micro-batches
a bucket's buffer lives from the first micro-batch's backward through its blocks to the last one's
reduce-scatter (the gradients accumulate in it): ZeRO-2 here does not reduce-scatter every
micro-batch, which would hold less but add M - 1 reduce-scatters a step and change the order of
the sums.

    release = GradRelease(reducer.buckets)    # made by GradReducer(..., release=True)
    release.need(i)                           # before block i's backward (None: the head, the embedding)
    release.drop(k)                           # bucket k's reduce-scatter is done
"""
from __future__ import annotations

from mpi_tp.core import backend


class GradRelease:
    """Which buckets hold their whole gradient buffer now; allocates and drops them."""

    def __init__(self, buckets: list):
        self.buckets = buckets
        self.shape = [(b.grads.size, b.grads.dtype) for b in buckets]
        self.of_block: dict = {}                        # block index (None: the rest) -> its buckets
        for k, b in enumerate(buckets):
            for i in (b.blocks or {None}):
                self.of_block.setdefault(i, []).append(k)
        self.allocations = 0                            # buffers made again (a test reads it)
        for k in range(len(buckets)):
            self.drop(k)

    def need(self, i) -> None:
        """Block i's backward is about to run: make its buckets' buffers (zeroed) if they were dropped."""
        for k in self.of_block.get(i, ()):
            b = self.buckets[k]
            if b.grads is not None:
                continue
            n, dtype = self.shape[k]
            b.grads = backend.xp().zeros(n, dtype=dtype)
            for at, base, members in b.stores:
                view = b.grads[at:at + base.size].reshape(base.shape)
                for p in members:
                    p.grad_base, p.grad, p.fresh = view, view[p.view], True
            self.allocations += 1

    def drop(self, k: int) -> None:
        """Bucket k's gradients are in its share: let the whole buffer go (its parameters' grads are None)."""
        b = self.buckets[k]
        b.grads = None
        for _, _, members in b.stores:
            for p in members:
                p.grad_base = p.grad = None
                p.fresh = False               # so that nothing writes into a missing buffer unseen (Param.accumulate)

    def held_bytes(self) -> int:
        """Bytes of whole gradient buffers held now."""
        return sum(int(b.grads.nbytes) for b in self.buckets if b.grads is not None)


class ChunkGrads:
    """A pipeline chunk's view of a GradRelease: its block i is block offset + i of the stage."""

    def __init__(self, release: GradRelease, offset: int):
        self.release, self.offset = release, offset

    def need(self, i) -> None:
        self.release.need(None if i is None else self.offset + i)
