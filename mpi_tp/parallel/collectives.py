"""Every collective the model uses, counted: the one place where a training step communicates.

`Group` wraps an MPI communicator of the ranks that cooperate on one parallel
dimension (tensor, data, ...). Its methods are the only MPI calls of a step;
the regions built on them (f, g, scatter, gather in `tensor_parallel`, their
sequence-parallel forms in `sequence_parallel`) are what layers call.

All transfers use mpi4py's buffer (uppercase) methods on contiguous arrays,
so nothing is pickled. Device (CuPy) arrays go to MPI directly or through
pooled pinned host buffers (mpi_tp.core.gpu.Stager). Each call is recorded in `CommStats` (calls, bytes,
wire bytes, seconds per group and kind); one-rank groups return before any MPI call and
record nothing, since nothing is communicated.

What the counters mean (buffer bytes, wire bytes): mpi_tp.parallel.comm_stats.
"""
from __future__ import annotations

import time

import numpy
from mpi4py import MPI

from mpi_tp.core import backend
from mpi_tp.parallel.comm_stats import CommStats


def _check_buffer(x, what: str) -> None:
    """MPI reads raw memory: refuse views it would misread, before any rank enters the call."""
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: buffer must be C-contiguous (got strides {x.strides})")
    if x.dtype.kind not in "fiu":
        raise ValueError(f"{what}: unsupported dtype {x.dtype}")


def _in_place(call, x, result: bool = True) -> None:
    """call(buf) with the buffer MPI should see for x (x itself, or a lent pinned copy of a device array);
    afterwards x holds what MPI left in buf (when `result`), and buf goes back to the pool."""
    stager = backend.stager()
    buf = stager.lend(x)
    call(buf)
    stager.give_back(x, buf, copy=result)


def _out_of_place(call, send, out) -> None:
    """call(send_buf, recv_buf) for MPI reading `send` and writing `out` (both staged as in _in_place)."""
    stager = backend.stager()
    send_buf, recv_buf = stager.lend(send), stager.lend(out, copy=False)
    call(send_buf, recv_buf)
    stager.give_back(send, send_buf, copy=False)
    stager.give_back(out, recv_buf)


class Pending:
    """A started non-blocking operation: wait() completes it (and copies a staged GPU buffer back into x
    when MPI wrote it: result=True for an all-reduce or a receive, False for a send)."""

    def __init__(self, request, x, buf, record, result: bool = True):
        self.request, self.x, self.buf, self._record = request, x, buf, record   # buf: lent by the stager
        self.result = result

    def test(self) -> bool:
        """Let MPI make progress; True once the operation is complete (and then finished as wait() does)."""
        if self.request is not None and self.request.Test():
            self._done()
        return self.request is None

    def wait(self):
        if self.request is not None:
            self.request.Wait()
            self._done()
        return self.x

    def cancel(self) -> None:
        """Withdraw a receive that is no longer wanted (a pipeline run that failed part-way), so that it
        cannot match a later message; completes the request whether or not a message had arrived."""
        if self.request is not None:
            self.request.Cancel()
            self.request.Wait()
            backend.stager().give_back(self.x, self.buf, copy=False)
            self.request = None

    def _done(self) -> None:
        backend.stager().give_back(self.x, self.buf, copy=self.result)
        stats, key, t0 = self._record
        now = time.perf_counter()
        stats.seconds[key] += now - t0                           # from start to completion
        if stats.trace is not None:
            stats.trace.complete(key, "comm", t0, now, bytes=int(self.x.nbytes))
        self.request = None


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
        _check_buffer(x, f"{self.name}.all_reduce")
        t0 = time.perf_counter()
        _in_place(lambda buf: self.comm.Allreduce(MPI.IN_PLACE, buf, op=op), x)
        self.stats.record(f"{self.name}/{kind}", x.nbytes, time.perf_counter() - t0, self._ring(2 * x.nbytes))
        return x

    def _ring(self, n: float) -> float:
        return n * (self.size - 1) / self.size

    def iall_reduce(self, x, op=MPI.SUM) -> "Pending":
        """Start x = op over the group of every rank's x (in place); returns a handle to wait on."""
        if self.size == 1:
            return Pending(None, x, x, None)
        _check_buffer(x, f"{self.name}.iall_reduce")
        buf = backend.stager().lend(x)           # its own buffer until wait(): buckets run concurrently
        t0 = time.perf_counter()
        req = self.comm.Iallreduce(MPI.IN_PLACE, buf, op=op)
        self.stats.record(f"{self.name}/iall_reduce", x.nbytes, 0.0, self._ring(2 * x.nbytes), timed=False)
        return Pending(req, x, buf, (self.stats, f"{self.name}/iall_reduce", t0))

    # -- point to point (pipeline stages) ----------------------------------

    def isend(self, x, dest: int, tag: int) -> "Pending":
        """Start sending x to rank `dest` of the group; x must stay unchanged until wait()."""
        _check_buffer(x, f"{self.name}.isend")
        buf = backend.stager().lend(x)
        t0 = time.perf_counter()
        req = self.comm.Isend(buf, dest=dest, tag=tag)
        self.stats.record(f"{self.name}/send", x.nbytes, 0.0, float(x.nbytes), timed=False)
        return Pending(req, x, buf, (self.stats, f"{self.name}/send", t0), result=False)

    def irecv(self, x, source: int, tag: int) -> "Pending":
        """Start receiving into x (preallocated: its shape and dtype are agreed in advance, nothing else
        is exchanged) from rank `source` of the group; x holds the message after wait()."""
        _check_buffer(x, f"{self.name}.irecv")
        buf = backend.stager().lend(x, copy=False)
        t0 = time.perf_counter()
        req = self.comm.Irecv(buf, source=source, tag=tag)
        self.stats.record(f"{self.name}/recv", x.nbytes, 0.0, timed=False)
        return Pending(req, x, buf, (self.stats, f"{self.name}/recv", t0))

    def all_gather(self, x, sizes: list[int], axis: int):
        """Concatenate every rank's x along `axis`; rank r contributes sizes[r] entries (Allgatherv)."""
        if self.size == 1:
            return x
        xp = backend.array_module(x)
        if len(sizes) != self.size or x.shape[axis] != sizes[self.rank]:
            raise ValueError(f"{self.name}.all_gather: shard of shape {x.shape} does not match sizes {sizes}")
        front = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))            # rank-major blocks need axis first
        _check_buffer(front, f"{self.name}.all_gather")
        per = int(numpy.prod(front.shape[1:]))
        counts = [s * per for s in sizes]
        displs = [sum(counts[:r]) for r in range(self.size)]
        t0 = time.perf_counter()
        out = xp.empty((sum(sizes),) + front.shape[1:], dtype=x.dtype)  # in the array module in use
        _out_of_place(lambda send, recv: self.comm.Allgatherv(send, [recv, (counts, displs)]), front, out)
        if axis % x.ndim != 0:
            out = xp.ascontiguousarray(xp.moveaxis(out, 0, axis))
        self.stats.record(f"{self.name}/all_gather", out.nbytes, time.perf_counter() - t0, self._ring(out.nbytes))
        return out

    def all_gather_inplace(self, flat, sizes: list[int]):
        """flat (1-D) holds this rank's sizes[rank] entries at its offset; fill in everyone else's."""
        if self.size == 1:
            return flat
        _check_buffer(flat, f"{self.name}.all_gather_inplace")
        counts = list(sizes)
        displs = [sum(counts[:r]) for r in range(self.size)]
        t0 = time.perf_counter()
        _in_place(lambda buf: self.comm.Allgatherv(MPI.IN_PLACE, [buf, (counts, displs)]), flat)
        self.stats.record(f"{self.name}/all_gather", flat.nbytes, time.perf_counter() - t0, self._ring(flat.nbytes))
        return flat

    def reduce_scatter(self, x, sizes: list[int], axis: int):
        """Sum x over the group and keep this rank's sizes[rank] entries along `axis` (Reduce_scatter)."""
        if self.size == 1:
            return x
        xp = backend.array_module(x)
        if len(sizes) != self.size or x.shape[axis] != sum(sizes):
            raise ValueError(f"{self.name}.reduce_scatter: array of shape {x.shape} does not match sizes {sizes}")
        front = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))
        _check_buffer(front, f"{self.name}.reduce_scatter")
        per = int(numpy.prod(front.shape[1:]))
        t0 = time.perf_counter()
        out = xp.empty((sizes[self.rank],) + front.shape[1:], dtype=x.dtype)
        counts = [s * per for s in sizes]
        _out_of_place(lambda send, recv: self.comm.Reduce_scatter(send, recv, counts, op=MPI.SUM), front, out)
        if axis % x.ndim != 0:
            out = xp.ascontiguousarray(xp.moveaxis(out, 0, axis))
        self.stats.record(f"{self.name}/reduce_scatter", x.nbytes, time.perf_counter() - t0, self._ring(x.nbytes))
        return out

    def all_gather_last(self, x, sizes: list[int]):
        """Concatenate every rank's x along the last axis: (..., sizes[rank]) -> (..., sum(sizes))."""
        return self.all_gather(x, sizes, axis=-1)

    def broadcast(self, x, root: int = 0):
        """Every rank's x becomes root's x, in place; returns x."""
        if self.size == 1:
            return x
        _check_buffer(x, f"{self.name}.broadcast")
        t0 = time.perf_counter()
        _in_place(lambda buf: self.comm.Bcast(buf, root=root), x)
        self.stats.record(f"{self.name}/broadcast", x.nbytes, time.perf_counter() - t0)
        return x

    def reduce_to_root(self, x, root: int = 0):
        """Sum every rank's x into root's x (in place there); the others' x is left as it was."""
        if self.size == 1:
            return x
        _check_buffer(x, f"{self.name}.reduce")
        t0 = time.perf_counter()
        if self.rank == root:
            _in_place(lambda buf: self.comm.Reduce(MPI.IN_PLACE, buf, op=MPI.SUM, root=root), x)
        else:
            _in_place(lambda buf: self.comm.Reduce(buf, None, op=MPI.SUM, root=root), x, result=False)
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
        _check_buffer(x, f"{self.name}.all_to_all")
        t0 = time.perf_counter()
        out = backend.array_module(x).empty_like(x)
        _out_of_place(lambda send, recv: self.comm.Alltoall(send, recv), x, out)
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
        _check_buffer(x, f"{self.name}.all_to_allv")
        per = int(numpy.prod(x.shape[1:]))
        send = [n * per for n in send_rows]
        recv = [n * per for n in recv_rows]
        t0 = time.perf_counter()
        out = backend.array_module(x).empty((sum(recv_rows),) + x.shape[1:], dtype=x.dtype)
        _out_of_place(lambda s, r: self.comm.Alltoallv([s, (send, _displacements(send))],
                                                       [r, (recv, _displacements(recv))]), x, out)
        sent = (sum(send_rows) - send_rows[self.rank]) * per * x.itemsize
        self.stats.record(f"{self.name}/all_to_allv", sent, time.perf_counter() - t0, float(sent))
        return out


def _displacements(counts: list[int]) -> list[int]:
    """Where each rank's block starts: _displacements([2, 0, 3]) == [0, 2, 2]."""
    return [sum(counts[:r]) for r in range(len(counts))]
