"""GPU specifics: is the MPI library CUDA-aware, and pinned host buffers for when it is not.

mpi4py has no query for CUDA support, but MPICH and Open MPI export
`MPIX_Query_cuda_support()` from their shared library. We find the library this
process loaded (/proc/self/maps) and ask it; MPI_TP_CUDA_AWARE=0/1 overrides
the answer (some builds answer 1 without the runtime support switched on).

With a CUDA-aware MPI, device buffers go to MPI directly (after synchronising
the stream, since MPI does not see CUDA streams). Without one, every collective
copies through page-locked ("pinned") host buffers, which the GPU copies at
full PCIe speed; the buffers are kept and reused by size.
"""
from __future__ import annotations

import ctypes
import os


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


class PinnedStager:
    """Page-locked host buffers, reused by size, for copying device arrays to and from MPI."""

    def __init__(self):
        self._buffers = {}

    def host_copy(self, x):
        """A NumPy array in pinned memory holding x's values (x: a CuPy array)."""
        import cupyx
        key = (x.shape, x.dtype.str)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = cupyx.empty_pinned(x.shape, dtype=x.dtype)
        x.get(out=buf)
        return buf

    @staticmethod
    def copy_back(x, host) -> None:
        x.set(host)
