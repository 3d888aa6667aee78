"""Context parallelism: the sequence itself split over the ranks of a cp group, for the whole block.

Legend (docs/notation.md): S = sequence, Z = the cp group's size, r = this rank's place in it.

Sequence parallelism splits the positions only between the tensor-parallel regions, and attention
still sees the whole sequence. Context parallelism splits them everywhere: each rank holds S / Z
positions of every sequence from the embedding to the loss, and holds every weight (whole, or its
tensor-parallel shard), so the weights' gradients are summed over cp as over dp (the gradient
reducer's group is cp x dp: Topology.dpcp). Every layer but attention acts on each position alone
and runs unchanged on a rank's positions; attention needs every earlier position's keys and values,
which travel around the ring of the cp ranks (mpi_tp.parallel.ring_attention).

Which positions: the sequence is cut into 2Z chunks (sizes differ by at most one: S need not divide),
and rank r holds chunks r and 2Z - 1 - r, one from each end:

    Z = 2, S = 8:   chunks  [0 1][2 3][4 5][6 7]     rank 0: chunks 0, 3 = positions 0 1 6 7
                                                     rank 1: chunks 1, 2 = positions 2 3 4 5

Why both ends: under the causal mask a query sees only earlier keys. With a plain split (rank r the
r-th quarter), rank 0's queries see only its own keys, and in the ring's steps it has nothing to do
while the last rank, whose queries see every key, works through all of them: the ring runs at the
pace of the busiest rank, and the others idle through about half of it. With a chunk from each end,
at every ring step each rank computes the same amount: against a lower rank's keys both of its
chunks see that rank's first chunk whole (and not its second); against a higher rank's keys its
second chunk sees both of that rank's chunks whole (and its first sees neither): half a block
either way, and a causal pair of half blocks at the step with its own keys.

The embedding and the rotary angles use each position's global index; the loss of a rank is the sum
over its positions divided by the replica's whole count, times Z (so that the reducer's average over
cp x dp sums over cp and averages over dp), and the reported loss is that sum over cp (one scalar
all-reduce).
"""
from __future__ import annotations

import numpy

from mpi_tp.core import backend
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.topology import TopologyError, offsets, split_sizes


class ContextSplit:
    """The cut of one sequence length S over the cp group: 2Z chunks, two per rank (frozen: a micro-batch's
    pass builds it once, mpi_tp.model.forward_pass)."""

    def __init__(self, group: Group, S: int):
        n = 2 * group.size
        if S < n:
            raise TopologyError(f"a sequence of {S} positions cannot be cut into 2 x cp = {n} chunks: use "
                                f"sequences of at least {n} positions, or a smaller --cp")
        self.group, self.S, self.sizes = group, S, split_sizes(S, n)
        self.starts = offsets(self.sizes)
        self.shared = {}          # what every block of the pass shares (the rope angles of these positions)

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        r = self.group.rank if rank is None else rank
        return r, 2 * self.group.size - 1 - r

    def runs(self, rank: int | None = None) -> list[tuple[int, int, int, int]]:
        """(local start, local stop, global start, chunk) of each chunk of `rank` (default this rank),
        in its local order."""
        out, at = [], 0
        for c in self.chunks(rank):
            out.append((at, at + self.sizes[c], self.starts[c], c))
            at += self.sizes[c]
        return out

    def length(self, rank: int | None = None) -> int:
        """Positions held by `rank` (default this rank)."""
        return sum(self.sizes[c] for c in self.chunks(rank))

    @property
    def positions(self) -> numpy.ndarray:
        """This rank's global positions, in local order (host int64)."""
        return self.positions_of(None)

    def positions_of(self, rank: int | None) -> numpy.ndarray:
        """`rank`'s global positions (default this rank's), in its local order (host int64)."""
        return numpy.concatenate([numpy.arange(g, g + b - a) for a, b, g, _ in self.runs(rank)])

    def take(self, a, axis: int = 1):
        """This rank's positions of a whole-sequence array (its two chunks, joined along axis)."""
        xp = backend.array_module(a)
        parts = [a[(slice(None),) * axis + (slice(g, g + b - l),)] for l, b, g, _ in self.runs()]
        return xp.ascontiguousarray(xp.concatenate(parts, axis=axis))

    def global_runs(self, local: slice) -> list[tuple[int, int]]:
        """The global positions [start, stop) of the local rows `local` (a slice of this rank's order)."""
        out = []
        for a, b, g, _ in self.runs():
            lo, hi = max(a, local.start), min(b, local.stop)
            if lo < hi:
                out.append((g + lo - a, g + hi - a))
        return out


def loss_weight(split: ContextSplit, local: int) -> float:
    """The factor on a rank's mean loss over its `local` positions that makes the reducer's average over
    cp x dp the whole sequence's mean (see the module docstring): Z local / S."""
    return split.group.size * local / split.S
