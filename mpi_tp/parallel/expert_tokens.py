"""Which tokens a rank routes in a mixture-of-experts block, and the routing of whole sequences from them.

Legend (docs/notation.md): B = batch, S = sequence, S_o = this rank's own positions, k = experts per token.

Every token is routed once, by the rank that owns its position: the positions of a cp rank's chunks
(mpi_tp.parallel.context_parallel) are cut again among the tp ranks by sequence parallelism's rule
(split_sizes), as if sequence parallelism were on. Under sequence parallelism they are what the rank
holds already; without it the tp ranks hold the same (B, S, C) and each keeps its own positions (a slice,
no communication), and the block's output is all-gathered back. So a decision is never computed twice,
and no two ranks can disagree on a near tie (tests/test_moe_tie.py).

What needs whole sequences (the capacity's admission order, the balance loss's share of each expert)
reads the routing of every position of this rank's sequences, gathered over the ranks that own them
(`Owners.whole`: k small integers per position, over tp then cp); sums over positions (the balance
loss's mean probabilities, the z-loss) are all-reduced over the same ranks (`Owners.sum`).
"""
from __future__ import annotations

import numpy

from mpi_tp.core import backend
from mpi_tp.parallel.topology import offsets, split_sizes


class Owners:
    """The owners of one pass's positions (frozen per forward). tp: the tensor-parallel group; S_cp: the
    positions of this rank's cp shard (S without cp) when sequence parallelism is off (sp_sizes None: they
    are cut by its rule here), else sp_sizes: its cut of them; cp: the pass's ContextSplit, or None."""

    def __init__(self, tp, S_cp: int, sp_sizes=None, cp=None):
        self.tp, self.cp, self.sliced = tp, cp, sp_sizes is None and tp.size > 1
        self.sizes = list(sp_sizes) if sp_sizes is not None else split_sizes(S_cp, tp.size)
        start = offsets(self.sizes)[tp.rank]
        local = numpy.arange(sum(self.sizes)) if cp is None else cp.positions     # the cp shard's global positions
        self.positions = local[start:start + self.sizes[tp.rank]]           # this rank's own ones

    @property
    def others(self) -> bool:
        """Whether other ranks own positions of these sequences."""
        return self.tp.size > 1 or self.cp is not None

    def whole(self, a):
        """a (B, S_o, ...) at this rank's positions -> (B, S, ...) at every position, the same on every owner."""
        if not self.others:
            return a
        a = self.tp.all_gather(a, self.sizes, axis=1, kind="routing")               # the cp shard's positions
        if self.cp is None:
            return a
        group = self.cp.group
        lengths = [self.cp.length(r) for r in range(group.size)]
        a = group.all_gather(a, lengths, axis=1, kind="routing")                    # every shard, rank by rank
        order = numpy.concatenate([self.cp.positions_of(r) for r in range(group.size)])
        out = backend.array_module(a).empty_like(a)
        out[:, backend.asarray(order)] = a
        return out

    def mine(self, a):
        """(B, S, ...) at every position -> this rank's positions (B, S_o, ...)."""
        if not self.others:
            return a
        return backend.array_module(a).ascontiguousarray(a[:, backend.asarray(self.positions)])

    def sum(self, x, kind: str = "routing_sums"):
        """x summed over the owners of these sequences (in place where it can; returns it)."""
        x = self.tp.all_reduce(x, kind=kind)
        return x if self.cp is None else self.cp.group.all_reduce(x, kind=kind)
