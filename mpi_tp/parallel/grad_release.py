"""ZeRO-2: a bucket's whole gradients held only from the backward pass that reaches its blocks.

Under ZeRO-2 (mpi_tp.parallel.buckets, stage 2) a bucket's whole gradient buffer is dropped once it
is reduce-scattered into the rank's share. It is held again, zeroed, not when the next step begins
but when its backward pass first reaches one of the bucket's blocks (the embeddings' and ln_f's
bucket: the head's or the embedding's backward): GPT.backward calls need(i) before block i. So during
the forward passes, when the activations peak, a rank holds its 1/D share of the gradients alone,
and with one micro-batch the blocks below the backward pass still hold none. With M micro-batches a
bucket's buffer lives from the first micro-batch's backward through its blocks to the last one's
reduce-scatter, since the gradients accumulate in it (DeepSpeed instead reduce-scatters every
micro-batch: less memory, M - 1 more reduce-scatters a step, another order of the sums).

    release = GradRelease(reducer.buckets)     # GradReducer makes it at stage 2
    ChunkGrads(release, offset).need(i)        # a pipeline chunk's block i is the stage's offset + i
"""
from __future__ import annotations


class GradRelease:
    """Which buckets hold the whole gradients of which block (None: the embeddings, ln_f, the head)."""

    def __init__(self, buckets: list):
        self.buckets = buckets
        self.of_block: dict = {}
        for k, b in enumerate(buckets):
            for i in (b.blocks or {None}):
                self.of_block.setdefault(i, []).append(k)
            b.drop_grads()                  # from the start: the first step's forward holds none either

    def need(self, i) -> None:
        """Block i's backward is about to run: its buckets' whole gradients held (zeroed) if dropped."""
        for k in self.of_block.get(i, ()):
            self.buckets[k].hold_grads()

    def held_bytes(self) -> int:
        """Bytes of whole gradient buffers held now."""
        return sum(int(b.grads.nbytes) for b in self.buckets if b.grads is not None)


class ChunkGrads:
    """A pipeline chunk's view of a GradRelease: its block i is block offset + i of the stage."""

    def __init__(self, release: GradRelease, offset: int):
        self.release, self.offset = release, offset

    def need(self, i) -> None:
        self.release.need(None if i is None else self.offset + i)
