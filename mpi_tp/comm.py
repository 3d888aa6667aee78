"""Every collective the model uses, counted, and Megatron's conjugate pairs built on them.

Layers never call MPI themselves. They call the four named regions of the
Megatron-LM paper (Shoeybi et al. 2019, section 3), each a forward/backward
pair in which one side communicates and the other does not:

    region           forward                       backward
    copy_to_tp       identity              (f)     all-reduce of the gradient
    reduce_from_tp   all-reduce            (g)     identity
    scatter_to_tp    keep this rank's slice        all-gather of the gradient
    gather_from_tp   all-gather (last axis)        keep this rank's slice

All transfers use mpi4py's buffer (uppercase) methods on contiguous arrays,
so nothing is pickled. CuPy arrays are staged through host memory. Each call is recorded in `CommStats` (calls, bytes,
seconds per group and kind); one-rank groups return before any MPI call and
record nothing, since nothing is communicated.

Bytes are the size of the array each rank ends up with: an all-reduce of
(B, T, C) float32 counts B*T*C*4, an all-gather counts the gathered array.
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
        self.seconds = defaultdict(float)

    def record(self, key: str, nbytes: int, seconds: float) -> None:
        self.calls[key] += 1
        self.bytes[key] += int(nbytes)
        self.seconds[key] += seconds

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.seconds.clear()

    def snapshot(self) -> dict:
        """{key: {"calls", "bytes", "seconds"}} for every key seen so far."""
        return {k: {"calls": self.calls[k], "bytes": self.bytes[k], "seconds": self.seconds[k]}
                for k in sorted(self.calls)}

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


def _staged(x):
    """A host buffer for MPI: x itself for NumPy arrays, a host copy for CuPy arrays.

    GPU arrays are staged through host memory so that any MPI library works
    (CUDA-aware MPI, which could take device pointers directly, is not assumed).
    """
    if backend.is_device_array(x):
        backend.synchronize()
        return x.get()
    return x


def _unstage(x, host):
    """Copy a staged host buffer back into the GPU array x (no-op for NumPy)."""
    if host is not x:
        x.set(host)
    return x


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

    def all_reduce(self, x, op=MPI.SUM):
        """x = op over the group of every rank's x, in place; returns x."""
        if self.size == 1:
            return x
        _check_buffer(x, f"{self.name}.all_reduce")
        t0 = time.perf_counter()
        buf = _staged(x)
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=op)
        _unstage(x, buf)
        self.stats.record(f"{self.name}/all_reduce", x.nbytes, time.perf_counter() - t0)
        return x

    def all_gather_last(self, x, sizes: list[int]):
        """Concatenate every rank's x along the last axis; rank r contributes sizes[r] columns.

        x: (..., sizes[rank]) -> (..., sum(sizes)). Uneven sizes go through Allgatherv.
        """
        if self.size == 1:
            return x
        if len(sizes) != self.size or x.shape[-1] != sizes[self.rank]:
            raise ValueError(f"{self.name}.all_gather_last: shard of shape {x.shape} does not match sizes {sizes}")
        xp = backend.array_module(x)
        x = xp.ascontiguousarray(x)
        _check_buffer(x, f"{self.name}.all_gather_last")
        lead = x.shape[:-1]
        rows = int(numpy.prod(lead))
        counts = [rows * s for s in sizes]
        displs = [sum(counts[:r]) for r in range(self.size)]
        t0 = time.perf_counter()
        flat = numpy.empty(sum(counts), dtype=x.dtype)   # rank-major: [rank 0's block | rank 1's block | ...]
        self.comm.Allgatherv(_staged(x), [flat, (counts, displs)])
        flat = xp.asarray(flat)                          # back to the GPU under CuPy
        out = xp.empty(lead + (sum(sizes),), dtype=x.dtype)
        col = 0
        for r, s in enumerate(sizes):  # each block is (..., s); lay it into its columns
            out[..., col:col + s] = flat[displs[r]:displs[r] + counts[r]].reshape(lead + (s,))
            col += s
        self.stats.record(f"{self.name}/all_gather", out.nbytes, time.perf_counter() - t0)
        return out

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
