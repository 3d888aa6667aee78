"""GPU specifics: is the MPI library CUDA-aware, and pinned host buffers for when it is not.

mpi4py has no query for CUDA support, but MPICH and Open MPI export
`MPIX_Query_cuda_support()` from their shared library. We find the library this
process loaded (/proc/self/maps) and ask it; MPI_TP_CUDA_AWARE=0/1 overrides
the answer (some builds answer 1 without the runtime support switched on).

With a CUDA-aware MPI, device buffers go to MPI directly (after synchronising
the stream, since MPI does not see CUDA streams). Without one, every collective
copies through page-locked ("pinned") host buffers, which the GPU copies at
full PCIe speed. `Stager` decides which, and keeps the pinned buffers in a pool:
a buffer is lent to one collective at a time and comes back when that
collective is finished, so collectives in flight together (the data-parallel
buckets) never share one.

This module does not import `mpi_tp.core.backend` (the backend imports it to
ask about CUDA support): a device array is recognised by its type's module.
"""
from __future__ import annotations

import ctypes
import os
from collections import defaultdict


def _loaded_mpi_libraries() -> list[str]:
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                name = os.path.basename(path)
                if name.startswith(("libmpi", "libmpich")) and ".so" in name and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def cuda_aware_mpi() -> bool:
    """True when the MPI library says it can take device pointers (or MPI_TP_CUDA_AWARE=1)."""
    forced = os.environ.get("MPI_TP_CUDA_AWARE")
    if forced in ("0", "1"):
        return forced == "1"
    from mpi4py import MPI  # noqa: F401  (loads the MPI library)
    for path in _loaded_mpi_libraries():
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return bool(query())
    return False


def is_device_array(a) -> bool:
    """True for CuPy arrays (without importing CuPy)."""
    return type(a).__module__.startswith("cupy")


PINNED_MB = 1024           # pinned bytes kept idle at most (MPI_TP_PINNED_MB), beyond which returned buffers go
SMALLEST = 4096            # the smallest size class, in bytes


def size_class(nbytes: int) -> int:
    """The pool's size class of a buffer of nbytes: the next power of two, at least SMALLEST."""
    return max(SMALLEST, 1 << max(0, int(nbytes) - 1).bit_length())


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value not in ("0", "1") else value == "1"


class CudaStreams:
    """The CUDA streams and events the stager's asynchronous copies use (CuPy's); tests pass a stand-in."""

    @staticmethod
    def new():
        import cupy
        return cupy.cuda.Stream(non_blocking=True)

    @staticmethod
    def current():
        import cupy
        return cupy.cuda.get_current_stream()

    @staticmethod
    def event(stream):
        """An event recorded on `stream` now (event.done, event.synchronize(); stream.wait_event(event))."""
        import cupy
        event = cupy.cuda.Event()
        event.record(stream)
        return event


class Stager:
    """The buffers MPI is handed for device arrays: the arrays themselves, or pooled pinned host copies.

        buf = stager.lend(x)          # before the MPI call (x's values copied in, unless copy=False)
        comm.Allreduce(IN_PLACE, buf)
        stager.give_back(x, buf)      # after it completes: values copied into x, buf back to the pool

    NumPy arrays pass through untouched. With a CUDA-aware MPI a device array goes to MPI itself,
    except into a non-blocking collective (`nonblocking=True`: Iallreduce, Iallgatherv,
    Ireduce_scatter): Open MPI 4.x, whose MPIX_Query_cuda_support answers 1, documents device
    buffers in point-to-point and blocking collectives only, so those are staged too unless
    `device_nonblocking` (MPI_TP_CUDA_AWARE_NONBLOCKING=1: an MPI known to take them, e.g. one built
    with UCC or NCCL collectives).

    The pool: pinned host buffers by size class (size_class: powers of two), each lent as a view of
    the shape and dtype asked for, so the MoE exchanges' varying row counts reuse a few buffers
    instead of one per shape; at most `limit` bytes (MPI_TP_PINNED_MB MiB) are kept idle, the rest
    freed when they come back. `allocate(shape, dtype)` makes a host buffer (pinned memory by
    default; tests pass numpy.empty); `release()` hands freed memory back to the system (CuPy's
    pinned pool keeps it otherwise). Counters: `allocated` buffers and `pinned_bytes` now held.
    """

    def __init__(self, cuda_aware: bool, allocate=None, synchronize=None, limit: int | None = None,
                 device_nonblocking: bool | None = None, release=None, streams=None):
        self.cuda_aware = cuda_aware
        self.streams = CudaStreams() if streams is None else streams
        flag = _env_flag("MPI_TP_CUDA_AWARE_NONBLOCKING")
        self.device_nonblocking = bool(flag) if device_nonblocking is None else device_nonblocking
        self.limit = int(float(os.environ.get("MPI_TP_PINNED_MB", PINNED_MB)) * 2**20) if limit is None else limit
        self._allocate, self._synchronize, self._release = allocate, synchronize, release
        self._free = defaultdict(list)        # size class -> flat uint8 host buffers not lent out
        self._out = {}                        # id(view lent) -> (its flat buffer, its size class)
        self._landing = []                    # (event, flat, size class): copies back to the device in flight
        self._stream = None                   # the copy stream (CuPy), made on first use
        self.lent = 0                         # buffers out now (0 between collectives)
        self.allocated = 0                    # buffers allocated so far
        self.pinned_bytes = 0                 # bytes of host buffers held now (lent and idle)

    def ready(self, x) -> None:
        """Wait for the device work that produces x (before a collective's clock starts: MPI does not see
        CUDA streams, and its time must not include queued compute)."""
        if is_device_array(x):
            self._sync()

    def lend(self, x, copy: bool = True, nonblocking: bool = False):
        if not is_device_array(x):
            return x
        if self.cuda_aware and (not nonblocking or self.device_nonblocking):
            self._sync()                      # MPI does not see CUDA streams
            return x
        if copy:
            self._sync()                      # (the copy below waits for the stream anyway)
        if self._landing:
            self._collect()
        cls = size_class(x.nbytes)
        free = self._free[cls]
        flat = free.pop() if free else self._new(cls)
        buf = flat[:x.nbytes].view(x.dtype).reshape(x.shape)
        self._out[id(buf)] = (flat, cls)
        self.lent += 1
        if copy:
            x.get(out=buf)
        return buf

    def give_back(self, x, buf, copy: bool = True, blocking: bool = True):
        """x (now holding buf's values when copy); buf returns to the pool. blocking=False (a non-blocking
        collective finishing inside the backward pass): the copy goes on the copy stream, the compute
        stream waits for it before its next kernel, and the host does not wait at all; the buffer
        returns to the pool once the copy is done."""
        if buf is x:
            return x
        flat, cls = self._out.pop(id(buf))
        self.lent -= 1
        if copy and not blocking:
            stream = self._copy_stream()
            x.set(buf, stream=stream)
            landed = self._event(stream)
            self._current_stream().wait_event(landed)
            self._landing.append((landed, flat, cls))
            return x
        if copy:
            x.set(buf)
        self._free[cls].append(flat)
        self._trim()
        return x

    def lend_started(self, x):
        """lend(x, nonblocking=True) for a non-blocking collective, with the copy to the host started on the
        copy stream instead of waited for: (buf, ready), ready None when buf holds x's values already,
        else an event (ready.done, ready.synchronize()) after which MPI may read buf. The compute stream
        goes on meanwhile (the data-parallel buckets' overlap)."""
        if not is_device_array(x) or (self.cuda_aware and self.device_nonblocking):
            return self.lend(x, nonblocking=True), None
        buf = self.lend(x, copy=False, nonblocking=True)
        if buf is x:                          # (cuda-aware for blocking ones only: staged all the same)
            return buf, None
        stream = self._copy_stream()
        stream.wait_event(self._event(self._current_stream()))     # after the kernels that made x
        x.get(out=buf, stream=stream, blocking=False)
        return buf, self._event(stream)

    def _collect(self) -> None:
        """Buffers whose copy back has landed return to the pool."""
        still = []
        for landed, flat, cls in self._landing:
            if landed.done:
                self._free[cls].append(flat)
            else:
                still.append((landed, flat, cls))
        self._landing = still

    def idle_bytes(self) -> int:
        return sum(cls * len(bufs) for cls, bufs in self._free.items())

    def _trim(self) -> None:
        """Free idle buffers, largest first, until at most `limit` bytes are idle."""
        freed = False
        for cls in sorted(self._free, reverse=True):
            while self._free[cls] and self.idle_bytes() > self.limit:
                self._free[cls].pop()
                self.pinned_bytes -= cls
                freed = True
        if freed and self._release is not None:
            self._release()

    def _copy_stream(self):
        if self._stream is None:
            self._stream = self.streams.new()
        return self._stream

    def _current_stream(self):
        return self.streams.current()

    def _event(self, stream):
        return self.streams.event(stream)

    def _new(self, nbytes: int):
        if self._allocate is None:
            import cupy
            import cupyx
            self._allocate = lambda s, d: cupyx.empty_pinned(s, dtype=d)
            self._release = cupy.get_default_pinned_memory_pool().free_all_blocks
        self.allocated += 1
        self.pinned_bytes += nbytes
        import numpy
        return self._allocate((nbytes,), numpy.uint8)

    def _sync(self) -> None:
        if self._synchronize is None:
            import cupy
            self._synchronize = lambda: cupy.cuda.get_current_stream().synchronize()
        self._synchronize()
