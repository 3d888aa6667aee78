"""Every collective the model uses, counted: the one place where a training step communicates.

`Group` wraps an MPI communicator of the ranks that cooperate on one parallel
dimension (tensor, data, ...). Its methods are the only MPI calls of a step;
the regions built on them (f, g, scatter, gather in `tensor_parallel`, their
sequence-parallel forms in `sequence_parallel`) are what layers call.

All transfers use mpi4py's buffer (uppercase) methods on contiguous arrays,
so nothing is pickled (the buffers and the started operations: `buffers`). Device (CuPy) arrays go to MPI directly or through
pooled pinned host buffers (mpi_tp.core.gpu.Stager). Each call is recorded in `CommStats` (calls, bytes,
wire bytes, seconds per group and kind: the seconds the rank was held in the calls, a non-blocking
operation's start, tests and wait, not its flight); one-rank groups return before any MPI call and
record nothing, since nothing is communicated.

What the counters mean (buffer bytes, wire bytes): mpi_tp.parallel.comm_stats.
"""
from __future__ import annotations

import time

import numpy
from mpi4py import MPI

from mpi_tp.core import backend
from mpi_tp.parallel.buffers import (Pending, axis_back, axis_first, check_buffer, displacements, in_place,
                                     out_of_place)
from mpi_tp.parallel.comm_stats import CommStats
from mpi_tp.parallel.formats import reduction, wire

TAG_UB_MINIMUM = 32767      # the least tag upper bound the MPI standard lets a library have


def tag_limit() -> int:
    """The largest message tag this MPI accepts. MPI_TAG_UB is an attribute of MPI_COMM_WORLD: the
    standard promises it there alone, and Open MPI answers None on communicators made by Split or
    Create_cart (MPICH answers on every one), so it is read from the world, never from a group's
    communicator. A world that answers nothing gets the standard's minimum."""
    value = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    return TAG_UB_MINIMUM if value is None else int(value)


class Group:
    """An MPI communicator of ranks that cooperate on one parallel dimension, with counted collectives."""

    def __init__(self, comm: MPI.Comm, name: str, stats: CommStats | None = None):
        self.comm = comm
        self.name = name
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.stats = CommStats() if stats is None else stats

    def __repr__(self) -> str:
        return f"Group({self.name}: rank {self.rank} of {self.size})"

    # -- raw collectives -------------------------------------------------

    def all_reduce(self, x, op=MPI.SUM, kind: str = "all_reduce"):
        """x = op over the group of every rank's x, in place; returns x. `kind` names it in the counters."""
        if self.size == 1:
            return x
        check_buffer(x, f"{self.name}.all_reduce")
        backend.stager().ready(x)       # queued device work is not communication
        t0 = time.perf_counter()
        in_place(lambda buf: self.comm.Allreduce(MPI.IN_PLACE, wire(buf), op=reduction(op, x)), x)
        self.stats.record(f"{self.name}/{kind}", x.nbytes, time.perf_counter() - t0, self._ring(2 * x.nbytes))
        return x

    def _ring(self, n: float) -> float:
        return n * (self.size - 1) / self.size

    def iall_reduce(self, x, op=MPI.SUM) -> "Pending":
        """Start x = op over the group of every rank's x (in place); returns a handle to wait on."""
        if self.size == 1:
            return Pending(None, x, x, None)
        check_buffer(x, f"{self.name}.iall_reduce")
        buf, ready = backend.stager().lend_started(x)   # its own buffer until wait(): buckets run together
        t0 = time.perf_counter()
        self.stats.record(f"{self.name}/iall_reduce", x.nbytes, 0.0, self._ring(2 * x.nbytes), timed=False)
        return Pending(None, x, buf, (self.stats, f"{self.name}/iall_reduce", t0), ready=ready,
                       start=lambda: self.comm.Iallreduce(MPI.IN_PLACE, wire(buf), op=reduction(op, x)))

    # -- point to point (pipeline stages) ----------------------------------

    def isend(self, x, dest: int, tag: int) -> "Pending":
        """Start sending x to rank `dest` of the group; x must stay unchanged until wait()."""
        check_buffer(x, f"{self.name}.isend")
        buf = backend.stager().lend(x)
        t0 = time.perf_counter()
        req = self.comm.Isend(wire(buf), dest=dest, tag=tag)
        self.stats.record(f"{self.name}/send", x.nbytes, time.perf_counter() - t0, float(x.nbytes), timed=False)
        return Pending(req, x, buf, (self.stats, f"{self.name}/send", t0), result=False)

    def irecv(self, x, source: int, tag: int) -> "Pending":
        """Start receiving into x (preallocated: its shape and dtype are agreed in advance, nothing else
        is exchanged) from rank `source` of the group; x holds the message after wait()."""
        check_buffer(x, f"{self.name}.irecv")
        buf = backend.stager().lend(x, copy=False)
        t0 = time.perf_counter()
        req = self.comm.Irecv(wire(buf), source=source, tag=tag)
        self.stats.record(f"{self.name}/recv", x.nbytes, time.perf_counter() - t0, timed=False)
        return Pending(req, x, buf, (self.stats, f"{self.name}/recv", t0))

    def _gather_plan(self, x, sizes: list[int], axis: int, what: str):
        """(x with axis first, the gathered array to fill, counts, displacements) for an Allgatherv."""
        xp = backend.array_module(x)
        if len(sizes) != self.size or x.shape[axis] != sizes[self.rank]:
            raise ValueError(f"{self.name}.{what}: shard of shape {x.shape} does not match sizes {sizes}")
        front = axis_first(x, axis, xp)
        check_buffer(front, f"{self.name}.{what}")
        per = int(numpy.prod(front.shape[1:]))
        counts = [s * per for s in sizes]
        out = xp.empty((sum(sizes),) + front.shape[1:], dtype=x.dtype)  # in the array module in use
        return front, out, counts, displacements(counts)

    def all_gather(self, x, sizes: list[int], axis: int, kind: str = "all_gather"):
        """Concatenate every rank's x along `axis`; rank r contributes sizes[r] entries (Allgatherv)."""
        if self.size == 1:
            return x
        front, out, counts, displs = self._gather_plan(x, sizes, axis, "all_gather")
        backend.stager().ready(front)       # queued device work is not communication
        t0 = time.perf_counter()
        out_of_place(lambda send, recv: self.comm.Allgatherv(wire(send), [wire(recv), (counts, displs)]), front, out)
        self.stats.record(f"{self.name}/{kind}", out.nbytes, time.perf_counter() - t0, self._ring(out.nbytes))
        return axis_back(out, axis, x.ndim, backend.array_module(x))

    def iall_gather(self, x, sizes: list[int], axis: int, kind: str = "all_gather") -> "Pending":
        """Start all_gather(x, sizes, axis); wait() returns the gathered array. x must stay unchanged."""
        if self.size == 1:
            return Pending(None, x, x, None)
        front, out, counts, displs = self._gather_plan(x, sizes, axis, "iall_gather")
        stager = backend.stager()
        send = stager.lend(front, nonblocking=True)
        recv = stager.lend(out, copy=False, nonblocking=True)
        t0 = time.perf_counter()
        req = self.comm.Iallgatherv(wire(send), [wire(recv), (counts, displs)])
        key = f"{self.name}/{kind}"
        self.stats.record(key, out.nbytes, time.perf_counter() - t0, self._ring(out.nbytes), timed=False)
        xp = backend.array_module(x)
        return Pending(req, out, recv, (self.stats, key, t0), then=lambda o: axis_back(o, axis, x.ndim, xp),
                       send=(front, send))

    def all_gather_inplace(self, flat, sizes: list[int]):
        """flat (1-D) holds this rank's sizes[rank] entries at its offset; fill in everyone else's."""
        if self.size == 1:
            return flat
        check_buffer(flat, f"{self.name}.all_gather_inplace")
        counts = list(sizes)
        displs = [sum(counts[:r]) for r in range(self.size)]
        backend.stager().ready(flat)       # queued device work is not communication
        t0 = time.perf_counter()
        in_place(lambda buf: self.comm.Allgatherv(MPI.IN_PLACE, [wire(buf), (counts, displs)]), flat)
        self.stats.record(f"{self.name}/all_gather", flat.nbytes, time.perf_counter() - t0, self._ring(flat.nbytes))
        return flat

    def _scatter_plan(self, x, sizes: list[int], axis: int, what: str, out=None):
        """(x with axis first, this rank's block to fill (out, if given), counts) for a Reduce_scatter."""
        xp = backend.array_module(x)
        if len(sizes) != self.size or x.shape[axis] != sum(sizes):
            raise ValueError(f"{self.name}.{what}: array of shape {x.shape} does not match sizes {sizes}")
        front = axis_first(x, axis, xp)
        check_buffer(front, f"{self.name}.{what}")
        per = int(numpy.prod(front.shape[1:]))
        shape = (sizes[self.rank],) + front.shape[1:]
        if out is None:
            out = xp.empty(shape, dtype=x.dtype)
        elif out.shape != shape or out.dtype != x.dtype:
            raise ValueError(f"{self.name}.{what}: out {out.shape} {out.dtype} is not {shape} {x.dtype}")
        check_buffer(out, f"{self.name}.{what}")
        return front, out, [s * per for s in sizes]

    def iall_gather_inplace(self, flat, sizes: list[int], kind: str = "all_gather") -> "Pending":
        """Start all_gather_inplace(flat, sizes): wait() leaves everyone's entries in flat."""
        if self.size == 1:
            return Pending(None, flat, flat, None)
        check_buffer(flat, f"{self.name}.iall_gather_inplace")
        counts = list(sizes)
        buf, ready = backend.stager().lend_started(flat)
        t0 = time.perf_counter()
        key = f"{self.name}/{kind}"
        self.stats.record(key, flat.nbytes, 0.0, self._ring(flat.nbytes), timed=False)
        return Pending(None, flat, buf, (self.stats, key, t0), ready=ready,
                       start=lambda: self.comm.Iallgatherv(MPI.IN_PLACE, [wire(buf), (counts, displacements(counts))]))

    def reduce_scatter(self, x, sizes: list[int], axis: int, kind: str = "reduce_scatter"):
        """Sum x over the group and keep this rank's sizes[rank] entries along `axis` (Reduce_scatter)."""
        if self.size == 1:
            return x
        front, out, counts = self._scatter_plan(x, sizes, axis, "reduce_scatter")
        backend.stager().ready(front)       # queued device work is not communication
        t0 = time.perf_counter()
        out_of_place(lambda send, recv: self.comm.Reduce_scatter(wire(send), wire(recv), counts,
                                                                  op=reduction(MPI.SUM, x)), front, out)
        self.stats.record(f"{self.name}/{kind}", x.nbytes, time.perf_counter() - t0, self._ring(x.nbytes))
        return axis_back(out, axis, x.ndim, backend.array_module(x))

    def ireduce_scatter(self, x, sizes: list[int], axis: int, kind: str = "reduce_scatter",
                        out=None) -> "Pending":
        """Start reduce_scatter(x, sizes, axis); wait() returns this rank's block of the sum (written into
        `out` when given, for axis 0: e.g. the distributed optimizer's gradient share)."""
        if self.size == 1:
            return Pending(None, x, x, None)
        if out is not None and axis % x.ndim != 0:
            raise ValueError(f"{self.name}.ireduce_scatter: out= needs axis 0")
        front, out, counts = self._scatter_plan(x, sizes, axis, "ireduce_scatter", out)
        stager = backend.stager()
        send, ready = stager.lend_started(front)
        recv = stager.lend(out, copy=False, nonblocking=True)
        t0 = time.perf_counter()
        key = f"{self.name}/{kind}"
        self.stats.record(key, x.nbytes, 0.0, self._ring(x.nbytes), timed=False)
        xp = backend.array_module(x)
        return Pending(None, out, recv, (self.stats, key, t0), then=lambda o: axis_back(o, axis, x.ndim, xp),
                       send=(front, send), ready=ready,
                       start=lambda: self.comm.Ireduce_scatter(wire(send), wire(recv), counts,
                                                                       op=reduction(MPI.SUM, x)))

    def all_gather_last(self, x, sizes: list[int]):
        """Concatenate every rank's x along the last axis: (..., sizes[rank]) -> (..., sum(sizes))."""
        return self.all_gather(x, sizes, axis=-1)

    def broadcast(self, x, root: int = 0):
        """Every rank's x becomes root's x, in place; returns x."""
        if self.size == 1:
            return x
        check_buffer(x, f"{self.name}.broadcast")
        backend.stager().ready(x)       # queued device work is not communication
        t0 = time.perf_counter()
        in_place(lambda buf: self.comm.Bcast(wire(buf), root=root), x)
        self.stats.record(f"{self.name}/broadcast", x.nbytes, time.perf_counter() - t0)
        return x

    def reduce_to_root(self, x, root: int = 0):
        """Sum every rank's x into root's x (in place there); the others' x is left as it was."""
        if self.size == 1:
            return x
        check_buffer(x, f"{self.name}.reduce")
        backend.stager().ready(x)       # queued device work is not communication
        t0 = time.perf_counter()
        if self.rank == root:
            in_place(lambda buf: self.comm.Reduce(MPI.IN_PLACE, wire(buf), op=reduction(MPI.SUM, x), root=root), x)
        else:
            in_place(lambda buf: self.comm.Reduce(wire(buf), None, op=reduction(MPI.SUM, x), root=root), x,
                     result=False)
        self.stats.record(f"{self.name}/reduce", x.nbytes, time.perf_counter() - t0, self._ring(x.nbytes))
        return x

    # -- all-to-all (expert parallelism) ----------------------------------------

    def all_to_all(self, x):
        """Block r of x goes to rank r, which keeps it as block `self.rank` of the result (Alltoall):
        x (size, ...) -> (size, ...), every block the same shape (e.g. counts agreed before an all_to_allv)."""
        if self.size == 1:
            return x
        if x.shape[0] != self.size:
            raise ValueError(f"{self.name}.all_to_all: leading axis {x.shape[0]} is not the group size {self.size}")
        check_buffer(x, f"{self.name}.all_to_all")
        backend.stager().ready(x)       # queued device work is not communication
        t0 = time.perf_counter()
        out = backend.array_module(x).empty_like(x)
        out_of_place(lambda send, recv: self.comm.Alltoall(wire(send), wire(recv)), x, out)
        sent = x.nbytes * (self.size - 1) // self.size
        self.stats.record(f"{self.name}/all_to_all", sent, time.perf_counter() - t0, float(sent))
        return out

    def all_to_allv(self, x, send_rows: list[int], recv_rows: list[int]):
        """Rows of x cut in consecutive blocks, block r (send_rows[r] rows) going to rank r; returns the
        rows received, rank r's block (recv_rows[r] rows) at its place in rank order (Alltoallv):
        x (sum(send_rows), ...) -> (sum(recv_rows), ...). recv_rows must be what the others send
        (exchange the counts first with all_to_all)."""
        if self.size == 1:
            return x
        if len(send_rows) != self.size or len(recv_rows) != self.size or x.shape[0] != sum(send_rows):
            raise ValueError(f"{self.name}.all_to_allv: {x.shape[0]} rows do not match send_rows {send_rows} "
                             f"(recv_rows {recv_rows}, group of {self.size})")
        check_buffer(x, f"{self.name}.all_to_allv")
        per = int(numpy.prod(x.shape[1:]))
        send = [n * per for n in send_rows]
        recv = [n * per for n in recv_rows]
        backend.stager().ready(x)       # queued device work is not communication
        t0 = time.perf_counter()
        out = backend.array_module(x).empty((sum(recv_rows),) + x.shape[1:], dtype=x.dtype)
        out_of_place(lambda s, r: self.comm.Alltoallv([wire(s), (send, displacements(send))],
                                                       [wire(r), (recv, displacements(recv))]), x, out)
        sent = (sum(send_rows) - send_rows[self.rank]) * per * x.itemsize
        self.stats.record(f"{self.name}/all_to_allv", sent, time.perf_counter() - t0, float(sent))
        return out
