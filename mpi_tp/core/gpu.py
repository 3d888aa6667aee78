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


class Stager:
    """The buffers MPI is handed for device arrays: the arrays themselves, or pooled pinned host copies.

        buf = stager.lend(x)          # before the MPI call (x's values copied in, unless copy=False)
        comm.Allreduce(IN_PLACE, buf)
        stager.give_back(x, buf)      # after it completes: values copied into x, buf back to the pool

    NumPy arrays pass through untouched. `allocate(shape, dtype)` makes a host
    buffer (pinned memory by default; tests pass numpy.empty).
    """

    def __init__(self, cuda_aware: bool, allocate=None, synchronize=None):
        self.cuda_aware = cuda_aware
        self._allocate, self._synchronize = allocate, synchronize
        self._free = defaultdict(list)        # (shape, dtype) -> host buffers not lent out
        self.lent = 0                         # buffers out now (0 between collectives)

    def lend(self, x, copy: bool = True):
        if not is_device_array(x):
            return x
        self._sync()                          # MPI does not see CUDA streams
        if self.cuda_aware:
            return x
        free = self._free[(x.shape, x.dtype.str)]
        buf = free.pop() if free else self._new(x.shape, x.dtype)
        self.lent += 1
        if copy:
            x.get(out=buf)
        return buf

    def give_back(self, x, buf, copy: bool = True):
        """x (now holding buf's values when copy); buf returns to the pool."""
        if buf is x:
            return x
        if copy:
            x.set(buf)
        self._free[(buf.shape, buf.dtype.str)].append(buf)
        self.lent -= 1
        return x

    def _new(self, shape, dtype):
        if self._allocate is None:
            import cupyx
            self._allocate = lambda s, d: cupyx.empty_pinned(s, dtype=d)
        return self._allocate(shape, dtype)

    def _sync(self) -> None:
        if self._synchronize is None:
            import cupy
            self._synchronize = lambda: cupy.cuda.get_current_stream().synchronize()
        self._synchronize()
