"""The array module: NumPy on CPUs, CuPy on GPUs, chosen once per process.

Every array the model owns is created through `xp()`. Pure kernels never ask
which backend is active: they call `array_module(x)` on their input, so the
same code runs on NumPy and CuPy arrays.

    from mpi_tp.core import backend
    backend.use("cupy", comm=MPI.COMM_WORLD)   # each rank takes GPU local_rank % n_gpus
    xp = backend.xp()
"""
from __future__ import annotations

import os
import sys

import numpy

from mpi_tp.core.errors import UserError
from mpi_tp.core.gpu import Stager, cuda_aware_mpi

_xp = numpy
_name = "numpy"
_stager = Stager(cuda_aware=False)       # NumPy arrays pass through it untouched


class BackendError(UserError, ValueError):
    """The requested array backend cannot be used on this machine."""


def xp():
    """The active array module (numpy or cupy)."""
    return _xp


def name() -> str:
    return _name


def cuda_aware() -> bool:
    """Whether MPI takes device buffers directly (decided when CuPy is selected; see mpi_tp.core.gpu)."""
    return _stager.cuda_aware


def stager() -> Stager:
    """What the collectives hand MPI for an array of this backend (mpi_tp.core.gpu.Stager)."""
    return _stager


def array_module(a):
    """numpy or cupy, whichever owns `a` (NumPy for anything that is not a CuPy array)."""
    if _name == "cupy":
        import cupy
        return cupy.get_array_module(a)
    return numpy


def is_device_array(a) -> bool:
    return _name == "cupy" and type(a).__module__.startswith("cupy")


def asnumpy(a):
    """A host (NumPy) copy of `a`, or `a` itself when it already lives on the host."""
    if is_device_array(a):
        return _xp.asnumpy(a)
    return numpy.asarray(a)


def asarray(a, dtype=None):
    """`a` as an array of the active backend (copied to the GPU under CuPy)."""
    return _xp.asarray(a, dtype=dtype)


def synchronize() -> None:
    """Wait for queued GPU work; MPI reads device buffers directly, so call before any MPI call."""
    if _name == "cupy":
        _xp.cuda.get_current_stream().synchronize()


def node_local_rank(comm) -> int:
    """This rank's index among the ranks on its node (used to pick a GPU)."""
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return local.Get_rank()
    finally:
        local.Free()


def use(backend: str = "numpy", comm=None) -> None:
    """Select the array backend for this process, once, before any model is built.

    backend: "numpy" or "cupy". Under CuPy each rank binds to GPU
    (node-local rank) % (GPUs on the node); `comm` (default COMM_WORLD) must be
    every rank of the job, all calling together: the ranks agree, so that a rank
    whose GPU fails to start fails them all with its message (BackendError on
    every rank, the backend left as it was) instead of leaving them in a collective.
    MPI_TP_CUPY_STANDIN=1 selects the host stand-in for CuPy (mpi_tp.core.standin).
    """
    global _xp, _name, _stager
    if backend == "numpy":
        _xp, _name, _stager = numpy, "numpy", Stager(cuda_aware=False)
        _release_standin()
        return
    if backend != "cupy":
        raise BackendError(f"unknown backend {backend!r}: use 'numpy' or 'cupy'")
    from mpi_tp.core.runtime import collective_setup
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    local = node_local_rank(comm)          # the collective first, before anything that can fail on one rank
    local = int(os.environ.get("MPI_TP_LOCAL_RANK", local))
    try:
        cupy = collective_setup(_start_cupy, local, comm=comm)
    except UserError as e:                 # on every rank: the lowest failing rank's message
        if _name != "cupy":                # (a stand-in already in use stays where the Stager finds it)
            _release_standin()
        raise BackendError(str(e)) from None
    _xp, _name, _stager = cupy, "cupy", Stager(cuda_aware=cuda_aware_mpi())


def _start_cupy(local: int):
    """This rank's CuPy on GPU local % (GPUs here), or BackendError saying why not."""
    if os.environ.get("MPI_TP_CUPY_STANDIN") == "1":
        from mpi_tp.core import standin
        standin.install()
    try:
        import cupy
        n_gpus = cupy.cuda.runtime.getDeviceCount()
        if n_gpus > 0:
            cupy.cuda.Device(local % n_gpus).use()
    except Exception as e:  # ImportError, or CUDA present but unusable
        raise BackendError(
            f"--backend cupy needs CuPy and a working GPU ({type(e).__name__}: {e}); "
            "install the 'gpu' extra (pip install 'mpi_tp[gpu]') or use --backend numpy"
        ) from None
    if n_gpus == 0:
        raise BackendError("--backend cupy: CuPy sees no GPU; use --backend numpy")
    return cupy


def _release_standin() -> None:
    """Take the CuPy stand-in out of sys.modules if it was put there (without importing it otherwise)."""
    standin = sys.modules.get("mpi_tp.core.standin")
    if standin is not None:
        standin.uninstall()


def fused(fn):
    """fn, an elementwise function of arrays and scalars, compiled into one kernel by cupy.fuse when the
    backend is CuPy (a dozen kernel launches become one); under NumPy fn itself, called as it is."""
    kernel = {}

    def call(*args):
        if _name != "cupy":
            return fn(*args)
        if "k" not in kernel:
            kernel["k"] = _xp.fuse(kernel_name=fn.__name__)(fn)
        return kernel["k"](*args)
    call.__doc__, call.__name__, call.python = fn.__doc__, fn.__name__, fn
    return call
