"""Sequence parallelism (Korthikanti et al. 2022): the activations between the tensor-parallel
regions are split along the sequence (axis 1 of (B, S, C)), and f / g become an all-gather / a
reduce-scatter along it:

    region               forward                   backward
    gather_from_sp       all-gather (sequence)     reduce-scatter (sequence)   (replaces f)
    reduce_scatter_to_sp reduce-scatter (seq.)     all-gather (sequence)       (replaces g)

`enter_tp` / `leave_tp` pick f / g or their sequence-parallel replacements, so
the parallel layers have one code path. A column layer keeps only its input's
shard (B, S_i, K) for the backward pass and gathers it again there
(`regather_from_sp`, Korthikanti et al. 2022, sec. 4.2.2): one more all-gather
per column layer and step, for 1/T of its input's memory. A replicated
parameter (LayerNorm, row-parallel bias, position embedding) then sees only
this rank's positions: its gradient is marked Param.sp_partial and summed over
the group once per step (mpi_tp.parallel.finalize).
"""
from __future__ import annotations

import os

from mpi_tp.core import backend
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.tensor_parallel import (
    copy_to_tp,
    copy_to_tp_backward,
    reduce_from_tp,
    reduce_from_tp_backward,
)
from mpi_tp.parallel.topology import offsets, split_sizes


class SequenceSplit:
    """Sequence parallelism's cut of one pass's S positions among the tensor-parallel ranks (frozen: a
    micro-batch's pass builds it once, mpi_tp.model.forward_pass); shards differ by at most one position.
    """

    def __init__(self, group: Group, S: int, overlap: bool | None = None):
        """overlap: in a column layer's backward, start the input's all-gather before dX's GEMM and wait for
        it before dA's, and dX's reduce-scatter before dA's GEMM (Megatron's order), instead of one after
        the other. Default: MPI_TP_SP_OVERLAP=1, else off: on this project's 2-core build machine it made
        the backward 10-20% slower (experiments/comm/sp_overlap.py; MPICH progresses a non-blocking collective
        only inside MPI calls). Turn it on where the network or the GPU moves data while the cores compute."""
        self.group, self.S, self.sizes = group, S, split_sizes(S, group.size)
        self.overlap = os.environ.get("MPI_TP_SP_OVERLAP", "0") == "1" if overlap is None else overlap

    @property
    def positions(self) -> slice:
        """This rank's positions: a slice of the sequence axis."""
        start = offsets(self.sizes)[self.group.rank]
        return slice(start, start + self.sizes[self.group.rank])


# -- sequence-parallel regions (axis 1 of (B, S, C); sizes: every rank's positions) --------
# Each pair: `name(x, group, sizes)` is the forward, `name_backward(dout, group, sizes)` its gradient.


def gather_from_sp(x, group: Group, sizes: list[int]):
    """Enter a tensor-parallel region from a sequence-split one: (B, S_i, C) -> (B, S, C)."""
    return group.all_gather(x, sizes, axis=1)


def gather_from_sp_backward(dout, group: Group, sizes: list[int]):
    """Each rank's branch gave a partial dX for every position: sum them, keep this rank's positions."""
    return group.reduce_scatter(dout, sizes, axis=1)


def reduce_scatter_to_sp(x, group: Group, sizes: list[int]):
    """Leave a tensor-parallel region: sum the partial outputs, keep this rank's positions."""
    return group.reduce_scatter(x, sizes, axis=1)


def reduce_scatter_to_sp_backward(dout, group: Group, sizes: list[int]):
    """The output was split by position: every rank needs the whole gradient (all-gather)."""
    return group.all_gather(dout, sizes, axis=1)


# -- a region that every rank computes whole (the MoE router and dispatch) ----------------
# Its output is the same on every rank, complete: leaving it keeps this rank's positions (no
# communication) and entering it gathers them; each is the other's backward.


def gather_positions(x, group: Group, sizes: list[int]):
    """(B, S_i, C) -> (B, S, C), into a region whose result every rank computes whole (all-gather)."""
    return group.all_gather(x, sizes, axis=1)


def gather_positions_backward(dout, group: Group, sizes: list[int]):
    """The region's input gradient is whole and the same on every rank: keep this rank's positions."""
    start = offsets(sizes)[group.rank]
    return backend.array_module(dout).ascontiguousarray(dout[:, start:start + sizes[group.rank]])


def keep_positions(y, group: Group, sizes: list[int]):
    """(B, S, C) -> (B, S_i, C): leave such a region (every rank holds the whole y already)."""
    return gather_positions_backward(y, group, sizes)


def keep_positions_backward(dout, group: Group, sizes: list[int]):
    """Every rank needs the whole output gradient inside the region (all-gather)."""
    return gather_positions(dout, group, sizes)


def regather_from_sp(x, group: Group, sizes: list[int]):
    """Start gathering a column layer's kept input shard again, for its weight gradient:
    (B, S_i, K) -> (B, S, K) when waited. The second all-gather of Korthikanti et al. 2022, sec. 4.2.2:
    the layer keeps 1/T of its input between the passes instead of all of it."""
    return group.iall_gather(x, sizes, axis=1, kind="regather")


def start_gather_from_sp_backward(dout, group: Group, sizes: list[int]):
    """gather_from_sp_backward, started (the weight gradient's GEMM runs meanwhile): wait() gives it."""
    return group.ireduce_scatter(dout, sizes, axis=1)


# -- entering and leaving a tensor-parallel region, with or without sequence parallelism ----


def enter_tp(x, group: Group, sp: SequenceSplit | None):
    """Into a tensor-parallel region: f (x whole) or, under sequence parallelism, an all-gather.
    Returns (x whole, what the backward needs)."""
    if sp is not None:
        return gather_from_sp(x, group, sp.sizes), sp.sizes
    return copy_to_tp(x, group), None


def enter_tp_backward(dx, group: Group, sizes):
    if sizes is not None:
        return gather_from_sp_backward(dx, group, sizes)
    return copy_to_tp_backward(dx, group)


def leave_tp(y, group: Group, sp: SequenceSplit | None):
    """Out of a tensor-parallel region: g (all-reduce) or, under sequence parallelism, a reduce-scatter.
    Returns (y, what the backward needs)."""
    if sp is not None:
        return reduce_scatter_to_sp(y, group, sp.sizes), sp.sizes
    return reduce_from_tp(y, group), None


def leave_tp_backward(dout, group: Group, sizes):
    if sizes is not None:
        return reduce_scatter_to_sp_backward(dout, group, sizes)
    return reduce_from_tp_backward(dout, group)
