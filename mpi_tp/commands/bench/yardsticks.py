"""The machine's yardsticks that `mpi-tp bench` sets a step against, measured in the same run: the GEMM
peak, a bare all-reduce, the model's FLOPs per step, and the environment a figure names."""
from __future__ import annotations

import os
import platform
import time

import numpy
from mpi4py import MPI

from mpi_tp.core import backend, runtime
from mpi_tp.core.blas import matmul
from mpi_tp.core.blas import which as gemm_library
from mpi_tp.core.mpi_library import library_version
from mpi_tp.core.precision import is_half
from mpi_tp.core.runtime import cpu_name


def model_flops(C, L, S, B, V=256) -> float:
    n_mm = 12 * L * C * C + V * C
    return B * S * (6 * n_mm + 12 * L * C * S)


def gemm_peak(comm, n=2048, dtype="float32", reps=5) -> float:
    """GFLOP/s of one rank's n^3 GEMM while every rank runs the same GEMM (the fastest of reps: noise on
    a shared machine only slows a GEMM down, and a peak is what the machine can do), by the library that
    multiplies the model's matrices (mpi_tp.core.blas: MKL or NumPy's)."""
    xp = backend.xp()
    a = xp.asarray(numpy.random.default_rng(0).random((n, n), dtype=numpy.float32).astype(dtype))
    b = a.T.copy()
    matmul(a, b)
    times = []
    for _ in range(reps):
        comm.Barrier()
        t = time.perf_counter()
        matmul(a, b)
        backend.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / min(times) / 1e9


def allreduce_overhead(topo, shape, dtype, reps=30) -> dict:
    """Median seconds of our counted all-reduce of a (B, S, C) array of the backend, and of a bare mpi4py
    Allreduce of the same bytes in host memory: what MPI alone costs (a device array would need staging
    or a CUDA-aware MPI, which is what the counted one does)."""
    if topo.tp.size == 1:
        return {}
    buf = backend.xp().ones(shape, dtype=dtype)
    # MPI has no bfloat16: the bare call sums the same bytes as 16-bit integers (parallel.formats' words)
    host = numpy.ones(shape, dtype="uint16" if is_half(buf) else dtype)
    out = {}
    for name, fn in (("bare", lambda: topo.tp.comm.Allreduce(MPI.IN_PLACE, host)),
                     ("mpi_tp", lambda: (topo.tp.all_reduce(buf), backend.synchronize()))):
        fn()
        ts = []
        for _ in range(reps):
            topo.tp.comm.Barrier()
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out[name] = float(numpy.median(ts))
    return out


def environment(comm) -> dict:
    """What a figure ran on; malloc: what keep_freed_memory put in force, else the environment's MALLOC_*."""
    blas = {}
    try:
        from threadpoolctl import threadpool_info
        info = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if info:
            blas = {k: info[0].get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
    except ImportError:
        cfg = numpy.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = {"internal_api": cfg.get("name"), "version": cfg.get("version")}
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "blas": blas, "gemm": gemm_library(),
            "threads_per_rank": os.environ.get("OMP_NUM_THREADS", "unset"),
            "ranks": comm.Get_size(), "mpi": library_version(),
            "numpy": numpy.__version__, "python": platform.python_version(), "backend": backend.name(),
            "malloc": runtime.MALLOC or
            {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"},
            "date": time.strftime("%Y-%m-%d %H:%M")}
