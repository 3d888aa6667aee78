"""A strict host stand-in for CuPy: the GPU code path, run and counted on a machine without a GPU.

    MPI_TP_CUPY_STANDIN=1 mpiexec -n 2 mpi-tp train --backend cupy ...    # a whole job on the stand-in

    from mpi_tp.core import backend, standin
    backend.use("cupy", comm)             # with MPI_TP_CUPY_STANDIN=1 set: the stand-in, not CuPy
    standin.counters.reset()
    ...                                   # a step
    standin.counters.syncs, standin.counters.pinned_live_bytes
    backend.use("numpy")                  # and `import cupy` is what it was again

`install()` puts fake `cupy`, `cupy.cuda` and `cupyx` modules into sys.modules (so
that the real code path, `import cupy` included, runs unchanged) and `uninstall()`
takes them out; mpi_tp.core.backend calls them when MPI_TP_CUPY_STANDIN=1. Its
arrays (ndarray.py) hold NumPy arrays that nothing may read as host memory: no
implicit conversion, no buffer protocol, so MPI can take them only staged through
host buffers or, when MPI is declared CUDA-aware, by their "device" pointer
(state.py). Counters (counters.py) record what costs on a GPU: syncs, uploads,
pinned memory, kernels, float atomics, device buffers given to MPI.

It lives in the package rather than in tests/ so that the seam in backend.use can
reach it (the package never imports its tests) and whole `mpi-tp` jobs can run on it
(the start-up check is tested through the CLI). It imports nothing of mpi_tp but
mpi_tp.core.gpu's CUDA query. What it proves and what only a GPU can: docs/clusters.md.
"""
from __future__ import annotations

import sys

from mpi_tp.core.standin.counters import Counters, counters
from mpi_tp.core.standin.ndarray import ndarray
from mpi_tp.core.standin.state import StrictnessError, settings

__all__ = ["Counters", "StrictnessError", "counters", "install", "installed", "ndarray", "settings", "uninstall"]

_saved: dict | None = None        # what sys.modules held under the fake modules' names, while installed


def install() -> None:
    """Make `import cupy` / `import cupyx` give the stand-in (again: a no-op when installed)."""
    global _saved
    from mpi_tp.core.gpu import cuda_aware_mpi
    from mpi_tp.core.standin.modules import MODULES
    settings.cuda_aware = cuda_aware_mpi()
    if _saved is None:
        _saved = {name: sys.modules.get(name) for name in MODULES}
        sys.modules.update(MODULES)


def uninstall() -> None:
    """Give `cupy` and `cupyx` back to whatever they were (a no-op when not installed)."""
    global _saved
    if _saved is None:
        return
    for name, module in _saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
    _saved = None


def installed() -> bool:
    return _saved is not None
