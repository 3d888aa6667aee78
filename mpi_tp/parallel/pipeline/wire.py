"""What travels between pipeline stages: one micro-batch's activations (or their gradient), agreed in advance.

Without sequence parallelism every tensor-parallel rank of a stage holds the
whole activation (B, S, C): each sends only its 1/T of it, flattened, and the
receiving stage's ranks all-gather the pieces (Narayanan et al. 2021, sec. 4.1,
scatter/gather), so the link between stages carries B S C values once, not T
times. Under sequence parallelism each rank's activation is its S_i positions
already, (B, S_i, C), sent as it is.
"""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.parallel.topology import Topology, offsets, split_sizes


def wire_format(topo: Topology, sp, B: int, S: int, C: int):
    """(shape of a message between stages, to_wire, from_wire) for activations of B sequences of S positions
    on this rank (under sequence parallelism, sp: the pass's SequenceSplit of them).

    to_wire(a): this rank's piece of its activation a; from_wire(piece): the activation again."""
    tp = topo.tp
    if sp is not None:
        return (B, sp.sizes[tp.rank], C), (lambda a: a), (lambda a: a)
    if tp.size == 1:
        return (B, S, C), (lambda a: a), (lambda a: a)
    sizes = split_sizes(B * S * C, tp.size)
    start = offsets(sizes)[tp.rank]
    xp = backend.xp()

    def to_wire(a):
        return xp.ascontiguousarray(a.reshape(-1)[start:start + sizes[tp.rank]])

    def from_wire(piece):
        return tp.all_gather(piece, sizes, axis=0).reshape(B, S, C)
    return (sizes[tp.rank],), to_wire, from_wire
