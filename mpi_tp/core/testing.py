"""Checks for parallel code that fail together on every rank instead of hanging the others.

A plain `assert` that fails on one rank sends that rank on to the next test while
the others wait in a collective. `assert_close` computes the error locally,
takes the worst over the communicator, and raises on every rank with the same
message (llm.c's check_tensor: the max difference and the tolerance are printed).
"""
from __future__ import annotations

import time

import numpy
from mpi4py import MPI

from mpi_tp.core import backend


def max_rel_diff(actual, expected, scale: float | None = None) -> float:
    """max |actual - expected| / max(max |expected|, scale).

    `scale` is a floor for quantities whose true value is (close to) zero, e.g. the
    gradient of attention's key bias, which cancels in the softmax: compare those
    against the magnitude of the gradients around them, not against themselves.
    """
    a = backend.asnumpy(actual).astype(numpy.float64)
    b = backend.asnumpy(expected).astype(numpy.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape {a.shape} != expected {b.shape}")
    ref = max(float(numpy.abs(b).max(initial=0.0)), scale or 0.0, 1e-300)
    return float(numpy.abs(a - b).max(initial=0.0)) / ref


def from_rank0(fn, comm=MPI.COMM_WORLD, poll: float = 0.005):
    """fn() run on rank 0 alone and broadcast to every rank (an oracle, a serial reference). The others wait
    on a non-blocking barrier with short sleeps, not in MPI's busy wait: where ranks outnumber cores (the
    test suite's 4 ranks on 2), spinning ranks took the cores rank 0 was working on."""
    value = fn() if comm.Get_rank() == 0 else None
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll)
    return comm.bcast(value)


def all_true(ok: bool, comm=MPI.COMM_WORLD) -> bool:
    """True on every rank iff `ok` is true on every rank."""
    return bool(comm.allreduce(int(bool(ok)), op=MPI.MIN))


def assert_close(actual, expected, rtol: float, what: str = "tensor", scale: float | None = None,
                 comm=MPI.COMM_WORLD) -> float:
    """Assert max relative difference <= rtol on every rank; raise on all ranks if any fails."""
    try:
        err = max_rel_diff(actual, expected, scale)
    except AssertionError as e:  # a shape mismatch on one rank must still fail everywhere
        err, shape_msg = float("inf"), str(e)
    else:
        shape_msg = ""
    worst = comm.allreduce(err, op=MPI.MAX)
    if not worst <= rtol:
        where = comm.allreduce([(err, comm.Get_rank())] if err > rtol else [], op=MPI.SUM)
        ranks = ", ".join(f"rank {r}: {e:.3e}" for e, r in where)
        raise AssertionError(f"{what}: max relative difference {worst:.3e} > tolerance {rtol:.1e} "
                             f"({ranks}) {shape_msg}".rstrip())
    return worst


def gather_full(param, comm=MPI.COMM_WORLD, which: str = "data"):
    """The full tensor of a Param (its data or grad), assembled from every rank's shard.

    For tests and tools only: it pickles the shards (lowercase allgather).
    """
    local = backend.asnumpy(getattr(param, which))
    if not param.sharded:
        return local
    pieces = comm.allgather((param.start, param.stop, local))
    full = numpy.empty(param.global_shape, dtype=local.dtype)
    for start, stop, piece in pieces:
        idx = [slice(None)] * full.ndim
        idx[param.axis] = slice(start, stop)
        full[tuple(idx)] = piece
    return full


def randomize(module, seed: int = 123, std: float = 0.5) -> None:
    """Give every parameter (biases and LayerNorm weights included) random values, the same slice
    for slice at every layout, so that tests exercise terms a default init leaves at zero or one."""
    from mpi_tp.core.params import normal_shard
    for p in module.parameters():
        p.data[...] = normal_shard(p.name, p.global_shape, std, seed, p.data.dtype, p.axis, p.start,
                                   p.stop if p.sharded else None)
