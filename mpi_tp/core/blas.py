"""The matrix products of the linear layers: NumPy's BLAS, or Intel's MKL where it is faster.

    from mpi_tp.core.blas import matmul
    y = matmul(x, w)                    # 2-d, like x @ w
    matmul(x.T, dout, out=grad)         # into a C-ordered array

NumPy's wheels multiply with OpenBLAS. On Intel CPUs Intel's MKL (the `mkl` wheel: the `mkl` extra)
multiplies the model's matrices 15-35% faster on one core (C 256-2048 at 1024 rows, float32, the
Intel Xeon build machine; docs/performance.md), which is also why PyTorch, built on MKL, was ahead
there; on the AMD EPYC machine OpenBLAS was the faster one. So: MKL when its library is installed
and the CPU is Intel's, NumPy otherwise; MPI_TP_BLAS=numpy or =mkl decides instead. `which()` says
what runs (mpi-tp bench prints it).

MKL is called through ctypes (cblas_sgemm / cblas_dgemm, row-major) on 2-d float32 or float64
operands that are C- or F-ordered (an F-ordered one is passed transposed), writing a C-ordered
result; anything else (other dtypes, strided views, empty matrices, CuPy arrays) goes to NumPy.
The two libraries sum in different orders: results agree within float rounding, as two BLAS
builds do (tests/test_blas.py checks every layout against NumPy). MKL runs sequentially with one
thread per rank, else on the threads per rank that mpi_tp.core.runtime chose.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

import numpy

from mpi_tp.core.backend import array_module

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
_KINDS = {numpy.dtype(numpy.float32): 0, numpy.dtype(numpy.float64): 1}     # index into (sgemm, dgemm)
_mkl = None          # (sgemm, dgemm) once loaded; False when not used


def _intel() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "GenuineIntel" in f.read(4096)
    except OSError:
        return False


def check() -> tuple[str, list[str]]:
    """(MPI_TP_BLAS's choice, the MKL libraries in this Python's prefix), or a UserError for a bad setting: a
    value other than auto/numpy/mkl, or mkl asked for and not installed. Cheap (nothing loaded): the
    commands run it collectively at start (mpi_tp.commands.cli.main), so a bad setting is one message."""
    from mpi_tp.core.errors import UserError
    choice = os.environ.get("MPI_TP_BLAS", "auto")
    if choice not in ("auto", "numpy", "mkl"):
        raise UserError(f"MPI_TP_BLAS={choice!r}: use auto, numpy or mkl")
    paths = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    if choice == "mkl" and not paths:
        raise UserError("MPI_TP_BLAS=mkl but no libmkl_rt in this Python's prefix: pip install mkl")
    return choice, paths


def _load():
    """MKL's two GEMMs, or False: MPI_TP_BLAS=numpy, no MKL library, or (unless MPI_TP_BLAS=mkl) not Intel."""
    choice, paths = check()
    if choice == "numpy" or (choice == "auto" and not _intel()) or not paths:
        return False
    lib = ctypes.CDLL(paths[0])
    threads = int(os.environ.get("MKL_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or 1)
    if threads == 1:
        lib.MKL_Set_Threading_Layer(1)                        # MKL_THREADING_SEQUENTIAL: no OpenMP runtime
    else:
        lib.MKL_Set_Num_Threads(threads)
    i, p = ctypes.c_int, ctypes.c_void_p
    out = []
    for fn, real in ((lib.cblas_sgemm, ctypes.c_float), (lib.cblas_dgemm, ctypes.c_double)):
        fn.argtypes = [i, i, i, i, i, i, real, p, i, p, i, real, p, i]
        fn.restype = None
        out.append(fn)
    return tuple(out)


def which() -> str:
    """'mkl' or 'numpy': what multiplies the linear layers' matrices in this process."""
    global _mkl
    if _mkl is None:
        _mkl = _load()
    return "mkl" if _mkl else "numpy"


def _operand(a):
    """(transpose flag, leading dimension) of a 2-d operand for a row-major GEMM, or None."""
    if a.flags.c_contiguous:
        return NO_TRANS, max(a.shape[1], 1)
    if a.flags.f_contiguous:
        return TRANS, max(a.shape[0], 1)
    return None


def matmul(a, b, out=None):
    """a (M, K) @ b (K, N) -> (M, N), into `out` (C-ordered, (M, N)) when given, like numpy.matmul."""
    if which() == "numpy" or type(a) is not numpy.ndarray or type(b) is not numpy.ndarray:
        return array_module(a).matmul(a, b, out=out)
    M, K = a.shape
    N = b.shape[1]
    ta, tb = _operand(a), _operand(b)
    kind = _KINDS.get(a.dtype)
    if (kind is None or b.dtype != a.dtype or ta is None or tb is None or 0 in (M, N, K) or b.shape[0] != K
            or (out is not None and (out.dtype != a.dtype or out.shape != (M, N) or not out.flags.c_contiguous
                                     or numpy.may_share_memory(out, a) or numpy.may_share_memory(out, b)))):
        return numpy.matmul(a, b, out=out)
    if out is None:
        out = numpy.empty((M, N), dtype=a.dtype)
    _mkl[kind](ROW_MAJOR, ta[0], tb[0], M, N, K, 1.0, a.ctypes.data, ta[1], b.ctypes.data, tb[1], 0.0,
               out.ctypes.data, N)
    return out
