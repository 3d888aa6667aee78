"""Megatron's tensor-parallel regions: where the column and row splits communicate.

Layers never call MPI themselves. They call the four named regions of the
Megatron-LM paper (Shoeybi et al. 2019, section 3), each a forward/backward
pair in which one side communicates and the other does not:

    region           forward                       backward
    copy_to_tp       identity              (f)     all-reduce of the gradient
    reduce_from_tp   all-reduce            (g)     identity
    scatter_to_tp    keep this rank's slice        all-gather of the gradient
    gather_from_tp   all-gather (last axis)        keep this rank's slice

The collectives themselves (counted, buffer-based) are in `collectives`.
"""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.core.failpoints import planted
from mpi_tp.parallel.collectives import Group

# -- Megatron's conjugate regions ------------------------------------------
# Each pair: `name(x, group)` is the forward, `name_backward(dout, group)` its gradient.
# All-reduces work in place on their argument (a fresh partial sum or gradient).


def copy_to_tp(x, group: Group):
    """f: the input enters the tensor-parallel region unchanged (every rank holds it whole)."""
    return x


def copy_to_tp_backward(dout, group: Group):
    """f's gradient: each rank's branch contributed a part of dX, so sum them (all-reduce)."""
    if planted("bug-f-backward"):
        return dout
    return group.all_reduce(dout)


def reduce_from_tp(x, group: Group):
    """g: each rank holds a partial sum of the output; all-reduce gives every rank the whole."""
    return group.all_reduce(x)


def reduce_from_tp_backward(dout, group: Group):
    """g's gradient: the output was replicated, so its gradient already is (identity)."""
    return dout


def _own_columns(x, group: Group, sizes: list[int]):
    start = sum(sizes[:group.rank])
    xp = backend.array_module(x)
    return xp.ascontiguousarray(x[..., start:start + sizes[group.rank]])


def scatter_to_tp(x, group: Group, sizes: list[int]):
    """Keep this rank's columns of a replicated x: (..., sum(sizes)) -> (..., sizes[rank])."""
    if group.size == 1:
        return x
    return _own_columns(x, group, sizes)


def scatter_to_tp_backward(dout, group: Group, sizes: list[int]):
    """scatter's gradient: the full gradient is every rank's columns side by side (all-gather)."""
    return group.all_gather_last(dout, sizes)


def gather_from_tp(x, group: Group, sizes: list[int]):
    """All-gather column shards into the full last axis: (..., sizes[rank]) -> (..., sum(sizes))."""
    return group.all_gather_last(x, sizes)


def gather_from_tp_backward(dout, group: Group, sizes: list[int]):
    """gather's gradient: each rank keeps the gradient of its own columns (no communication)."""
    if group.size == 1:
        return dout
    return _own_columns(dout, group, sizes)
