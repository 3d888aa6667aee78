"""mpi_tp.core.blas: the linear layers' products through MKL (where it is chosen) equal NumPy's within float
rounding for every layout the kernels pass (C- or F-ordered operands, into a given C-ordered output),
float32 and float64, and what MKL cannot take (other dtypes, strided views, empty matrices, an output that
overlaps an operand) goes to NumPy; the choice follows MPI_TP_BLAS and the CPU. The MKL tests run where
the `mkl` wheel is installed (the test extra installs it on x86_64) and are skipped, with that reason,
elsewhere."""
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

from mpi_tp.core import blas

HAS_MKL = bool(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
needs_mkl = pytest.mark.skipif(not HAS_MKL, reason="the mkl wheel is not installed (pip install mkl)")


@pytest.fixture
def mkl(monkeypatch):
    """MKL chosen for this test, whatever the CPU (MPI_TP_BLAS=mkl); monkeypatch restores the process's choice."""
    monkeypatch.setenv("MPI_TP_BLAS", "mkl")
    monkeypatch.setattr(blas, "_mkl", None)
    assert blas.which() == "mkl"


@needs_mkl
@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float64, 1e-13)])
@pytest.mark.parametrize("a_order, b_order", [("C", "C"), ("C", "F"), ("F", "C"), ("F", "F")])
@pytest.mark.parametrize("M, K, N", [(1, 7, 5), (4, 33, 17), (64, 48, 80)])
def test_mkl_equals_numpy_in_every_layout(mkl, dtype, tol, a_order, b_order, M, K, N):
    rng = np.random.default_rng(M * K * N)
    a = np.asarray(rng.standard_normal((M, K)), dtype=dtype, order=a_order)
    b = np.asarray(rng.standard_normal((K, N)), dtype=dtype, order=b_order)
    want = a.astype(np.float64) @ b.astype(np.float64)
    got = blas.matmul(a, b)
    assert got.dtype == dtype and got.shape == (M, N) and got.flags.c_contiguous
    assert np.abs(got - want).max() <= tol * np.abs(want).max() * K
    out = np.full((M, N), np.nan, dtype=dtype)
    assert blas.matmul(a, b, out=out) is out and np.array_equal(out, got)


@needs_mkl
def test_what_mkl_cannot_take_goes_to_numpy(mkl):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((6, 8)), rng.standard_normal((8, 4))
    cases = {"int": (np.arange(6).reshape(2, 3), np.arange(6).reshape(3, 2)),
             "strided": (a[:, ::2], b[::2]),
             "empty": (a[:0], b),
             "mixed dtypes": (a.astype(np.float32), b)}
    for what, (x, y) in cases.items():
        assert np.array_equal(blas.matmul(x, y), np.matmul(x, y)), what
    square = rng.standard_normal((5, 5))
    out = square.copy()
    want = square @ square
    assert np.allclose(blas.matmul(out, square, out=out), want), "an output that overlaps an operand"


def test_the_choice_follows_mpi_tp_blas_and_the_cpu():
    """A fresh process: MPI_TP_BLAS=numpy is NumPy; unset, MKL exactly when installed on an Intel CPU;
    a bad value is one clear error."""
    probe = "from mpi_tp.core import blas; print(blas.which())"
    env = {k: v for k, v in os.environ.items() if k != "MPI_TP_BLAS"}

    def which(**extra):
        r = subprocess.run([sys.executable, "-c", probe], env={**env, **extra}, capture_output=True, text=True,
                           timeout=60)
        return r.stdout.strip() if r.returncode == 0 else r.stderr.strip().splitlines()[-1]
    assert which(MPI_TP_BLAS="numpy") == "numpy"
    assert which() == ("mkl" if HAS_MKL and blas._intel() else "numpy")
    assert "MPI_TP_BLAS='fast': use auto, numpy or mkl" in which(MPI_TP_BLAS="fast")


def test_every_command_refuses_a_bad_setting_at_start(tmp_path):
    """mpi_tp.commands.cli.main checks MPI_TP_BLAS before any command runs (blas.check, collectively): one
    line and status 2, before the command's own work (here inspect, which would otherwise report the
    missing checkpoint)."""
    env = {**os.environ, "MPI_TP_BLAS": "fast"}
    r = subprocess.run([sys.executable, "-m", "mpi_tp", "inspect", str(tmp_path / "none")], env=env,
                       capture_output=True, text=True, timeout=120)
    want = "mpi-tp: error: MPI_TP_BLAS='fast': use auto, numpy or mkl"
    assert r.returncode == 2 and r.stderr.strip() == want, r.stderr
