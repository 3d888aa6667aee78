"""Every collective the model uses, counted, and Megatron's conjugate pairs built on them.

Layers never call MPI themselves. They call the four named regions of the
Megatron-LM paper (Shoeybi et al. 2019, section 3), each a forward/backward
pair in which one side communicates and the other does not:

    region           forward                       backward
    copy_to_tp       identity              (f)     all-reduce of the gradient
    reduce_from_tp   all-reduce            (g)     identity
    scatter_to_tp    keep this rank's slice        all-gather of the gradient
    gather_from_tp   all-gather (last axis)        keep this rank's slice

With sequence parallelism (Korthikanti et al. 2022) the activations between
the parallel regions are split along the sequence (axis 1 of (B, S, C)), and
f / g become an all-gather / a reduce-scatter along it:

    gather_from_sp       all-gather (sequence)    reduce-scatter (sequence)   (replaces f)
    reduce_scatter_to_sp reduce-scatter (seq.)    all-gather (sequence)       (replaces g)

All transfers use mpi4py's buffer (uppercase) methods on contiguous arrays,
so nothing is pickled. CuPy arrays are staged through host memory. Each call is recorded in `CommStats` (calls, bytes,
seconds per group and kind); one-rank groups return before any MPI call and
record nothing, since nothing is communicated.

Bytes are the size of the array each rank ends up with: an all-reduce of
(B, T, C) float32 counts B*T*C*4, an all-gather counts the gathered array, a
reduce-scatter the array that is reduced. Wire bytes are what each rank sends
in the bandwidth-optimal (ring) algorithm for a group of p ranks: all-reduce
2n(p-1)/p, all-gather and reduce-scatter n(p-1)/p each. So a reduce-scatter
followed by an all-gather moves exactly what one all-reduce moves.
"""
from __future__ import annotations

import time
from collections import defaultdict

import numpy
from mpi4py import MPI

from . import backend


class CommStats:
    """Calls, bytes and seconds of every collective, keyed by "group/kind" (e.g. "tp/all_reduce")."""

    def __init__(self):
        self.calls = defaultdict(int)
        self.bytes = defaultdict(int)
        self.wire = defaultdict(float)
        self.seconds = defaultdict(float)

    def record(self, key: str, nbytes: int, seconds: float, wire: float = 0.0) -> None:
        self.calls[key] += 1
        self.bytes[key] += int(nbytes)
        self.wire[key] += wire
        self.seconds[key] += seconds

    def reset(self) -> None:
        for d in (self.calls, self.bytes, self.wire, self.seconds):
            d.clear()

    def snapshot(self) -> dict:
        """{key: {"calls", "bytes", "wire_bytes", "seconds"}} for every key seen so far."""
        return {k: {"calls": self.calls[k], "bytes": self.bytes[k], "wire_bytes": round(self.wire[k]),
                    "seconds": self.seconds[k]} for k in sorted(self.calls)}

    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def _check_buffer(x, what: str) -> None:
    """MPI reads raw memory: refuse views it would misread, before any rank enters the call."""
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: buffer must be C-contiguous (got strides {x.strides})")
    if x.dtype.kind not in "fiu":
        raise ValueError(f"{what}: unsupported dtype {x.dtype}")


_PINNED = None


def _staged(x):
    """The buffer to hand MPI: x itself for NumPy arrays and, with a CUDA-aware MPI, for CuPy arrays
    (after the stream is synchronised); otherwise a copy in pinned host memory (mpi_tp.gpu)."""
    global _PINNED
    if not backend.is_device_array(x):
        return x
    backend.synchronize()                       # MPI does not see CUDA streams
    if backend.cuda_aware():
        return x
    if _PINNED is None:
        from .gpu import PinnedStager
        _PINNED = PinnedStager()
    return _PINNED.host_copy(x)


def _unstage(x, host):
    """Copy a staged host buffer back into the GPU array x (no-op when MPI worked on x itself)."""
    if host is not x:
        x.set(host)
    return x


class Pending:
    """A started non-blocking collective: wait() completes it (and copies a staged GPU buffer back)."""

    def __init__(self, request, x, buf, record):
        self.request, self.x, self.buf, self._record = request, x, buf, record

    def test(self) -> bool:
        """Let MPI make progress; True once the collective is complete."""
        return self.request is None or self.request.Test()

    def wait(self):
        if self.request is not None:
            self.request.Wait()
            _unstage(self.x, self.buf)
            stats, key, t0 = self._record
            stats.seconds[key] += time.perf_counter() - t0      # from start to completion
            self.request = None
        return self.x


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
        buf = _staged(x)
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=op)
        _unstage(x, buf)
        self.stats.record(f"{self.name}/{kind}", x.nbytes, time.perf_counter() - t0, self._ring(2 * x.nbytes))
        return x

    def _ring(self, n: float) -> float:
        return n * (self.size - 1) / self.size

    def iall_reduce(self, x, op=MPI.SUM) -> "Pending":
        """Start x = op over the group of every rank's x (in place); returns a handle to wait on."""
        if self.size == 1:
            return Pending(None, x, x, None)
        _check_buffer(x, f"{self.name}.iall_reduce")
        buf = _staged(x)
        t0 = time.perf_counter()
        req = self.comm.Iallreduce(MPI.IN_PLACE, buf, op=op)
        self.stats.record(f"{self.name}/iall_reduce", x.nbytes, 0.0, self._ring(2 * x.nbytes))
        return Pending(req, x, buf, (self.stats, f"{self.name}/iall_reduce", t0))

    def all_gather(self, x, sizes: list[int], axis: int):
        """Concatenate every rank's x along `axis`; rank r contributes sizes[r] entries (Allgatherv)."""
        if self.size == 1:
            return x
        xp = backend.array_module(x)
        if len(sizes) != self.size or x.shape[axis] != sizes[self.rank]:
            raise ValueError(f"{self.name}.all_gather: shard of shape {x.shape} does not match sizes {sizes}")
        front = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))            # rank-major blocks need axis first
        per = int(numpy.prod(front.shape[1:]))
        counts = [s * per for s in sizes]
        displs = [sum(counts[:r]) for r in range(self.size)]
        t0 = time.perf_counter()
        out = numpy.empty((sum(sizes),) + front.shape[1:], dtype=x.dtype)
        self.comm.Allgatherv(_staged(front), [out, (counts, displs)])
        out = xp.ascontiguousarray(xp.moveaxis(xp.asarray(out), 0, axis))
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
        buf = _staged(flat)
        self.comm.Allgatherv(MPI.IN_PLACE, [buf, (counts, displs)])
        _unstage(flat, buf)
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
        per = int(numpy.prod(front.shape[1:]))
        t0 = time.perf_counter()
        out = numpy.empty((sizes[self.rank],) + front.shape[1:], dtype=x.dtype)
        self.comm.Reduce_scatter(_staged(front), out, [s * per for s in sizes], op=MPI.SUM)
        out = xp.ascontiguousarray(xp.moveaxis(xp.asarray(out), 0, axis))
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
        buf = _staged(x)
        self.comm.Bcast(buf, root=root)
        _unstage(x, buf)
        self.stats.record(f"{self.name}/broadcast", x.nbytes, time.perf_counter() - t0)
        return x

    def reduce_to_root(self, x, root: int = 0):
        """Sum every rank's x into root's x (in place there); the others' x is left as it was."""
        if self.size == 1:
            return x
        _check_buffer(x, f"{self.name}.reduce")
        t0 = time.perf_counter()
        buf = _staged(x)
        if self.rank == root:
            self.comm.Reduce(MPI.IN_PLACE, buf, op=MPI.SUM, root=root)
            _unstage(x, buf)
        else:
            self.comm.Reduce(buf, None, op=MPI.SUM, root=root)
        self.stats.record(f"{self.name}/reduce", x.nbytes, time.perf_counter() - t0, self._ring(x.nbytes))
        return x

    def barrier(self) -> None:
        if self.size > 1:
            self.comm.Barrier()


# -- Megatron's conjugate regions ------------------------------------------
# Each pair: `name(x, group)` is the forward, `name_backward(dout, group)` its gradient.
# All-reduces work in place on their argument (a fresh partial sum or gradient).


def copy_to_tp(x, group: Group):
    """f: the input enters the tensor-parallel region unchanged (every rank holds it whole)."""
    return x


def copy_to_tp_backward(dout, group: Group):
    """f's gradient: each rank's branch contributed a part of dX, so sum them (all-reduce)."""
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


# -- sequence-parallel regions (axis 1 of (B, S, C); sizes: every rank's positions) --------


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
