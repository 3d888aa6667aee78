"""The CuPy stand-in itself (mpi_tp.core.standin): at least as strict as CuPy, and counting what costs.

    python -m pytest -q --with-mpi tests/test_standin.py                       (CLI jobs: their own mpiexec)
    mpiexec -n 2 python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_standin.py

Its arrays refuse to become host memory unasked (numpy.asarray, the buffer protocol, mpi4py),
refuse host arrays as operands, and stay device arrays through every operation; host reads are
counted syncs, host data counted uploads. MPI takes them staged through pinned host buffers or,
when MPI is declared CUDA-aware, by pointer, outside non-blocking collectives (Open MPI 4.x's
rule: issue 21, finding 1). A collective's time leaves out the wait for queued GPU work (finding 3);
bench runs on the stand-in (finding 4). A rank whose GPU fails to start fails the whole job with one
message (finding 8). The slice of the suite on the stand-in runs at 1 and 2 ranks.
"""
import gc
import sys

import numpy
import pytest
from jobs import MPIEXEC, mpirun
from mpi4py import MPI

from mpi_tp.core import backend, standin
from mpi_tp.core.backend import BackendError
from mpi_tp.core.testing import all_true
from mpi_tp.parallel.collectives import Group

WORLD = MPI.COMM_WORLD
if WORLD.Get_size() > 2:
    pytest.skip("the stand-in slice runs at 1 and 2 ranks", allow_module_level=True)
cli = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--block-size", "8", "--batch-size", "2",
        "--steps", "2", "--eval-batches", "1", "--sample-len", "0", "--dtype", "float64"]


@pytest.fixture
def cupy(monkeypatch, world):
    """The stand-in as the backend for one test (MPI not CUDA-aware: staging), then NumPy again."""
    monkeypatch.setenv("MPI_TP_CUPY_STANDIN", "1")
    monkeypatch.setenv("MPI_TP_CUDA_AWARE", "0")
    backend.use("cupy", world)
    standin.counters.reset()
    yield sys.modules["cupy"]
    backend.use("numpy")
    assert "cupy" not in sys.modules or not getattr(sys.modules["cupy"], "__standin__", False)


@pytest.fixture
def cuda_aware(monkeypatch, world, cupy):
    """The stand-in with MPI declared CUDA-aware: device arrays go to MPI by pointer."""
    monkeypatch.setenv("MPI_TP_CUDA_AWARE", "1")
    backend.use("cupy", world)
    assert backend.cuda_aware() and standin.settings.cuda_aware
    standin.counters.reset()
    return cupy


@pytest.mark.parametrize("convert", [numpy.asarray, numpy.array, memoryview, bytes, numpy.ascontiguousarray,
                                     lambda x: numpy.add(x, numpy.ones(3)), lambda x: x + numpy.ones(3),
                                     lambda x: numpy.concatenate([x, numpy.ones((1, 3))]),
                                     lambda x: x.__reduce_ex__(2), lambda x: x.set([1.0, 2.0, 3.0])],
                         ids=["asarray", "array", "memoryview", "bytes", "ascontiguousarray", "ufunc with host",
                              "operator with host", "concatenate with host", "pickle", "set from a list"])
@pytest.mark.mpi(min_size=1)
def test_no_implicit_host_conversion(cupy, convert):
    x = cupy.arange(6.0).reshape(2, 3)                                   # (2, 3)
    with pytest.raises(TypeError):
        convert(x)
    assert standin.counters.syncs == 0


@pytest.mark.mpi(min_size=1)
def test_every_result_stays_on_the_device(cupy):
    host = numpy.arange(12.0).reshape(3, 4) - 5                          # (3, 4)
    x = cupy.asarray(host)
    idx = cupy.asarray([2, 0])
    cases = {
        "x + 1": (x + 1, host + 1), "1 - x": (1 - x, 1 - host), "x * x": (x * x, host * host),
        "x @ x.T": (x @ x.T, host @ host.T), "-abs(x) ** 2 / 2": (-abs(x) ** 2 / 2, -abs(host) ** 2 / 2),
        "x > 1": (x > 1, host > 1), "numpy.exp": (numpy.exp(x), numpy.exp(host)),
        "numpy.sum": (numpy.sum(x), numpy.sum(host)), "x.max(axis=0)": (x.max(axis=0), host.max(axis=0)),
        "x.T.reshape(-1)": (x.T.reshape(-1), host.T.reshape(-1)), "astype": (x.astype("f4"), host.astype("f4")),
        "x[0]": (x[0], host[0]), "x[0, 1]": (x[0, 1], host[0, 1]), "x[:, 1:]": (x[:, 1:], host[:, 1:]),
        "x[x > 2]": (x[x > 2], host[host > 2]), "x[idx]": (x[idx], host[[2, 0]]),
        "numpy.concatenate": (numpy.concatenate([x, x]), numpy.concatenate([host, host])),
        "numpy.where": (numpy.where(x > 1, x, 0), numpy.where(host > 1, host, 0)),
        "cupy.einsum": (cupy.einsum("ij,kj->ik", x, x), numpy.einsum("ij,kj->ik", host, host)),
        "numpy.moveaxis": (numpy.moveaxis(x, 0, 1), numpy.moveaxis(host, 0, 1)),
        "cupy.take_along_axis": (cupy.take_along_axis(x, cupy.argsort(x, axis=1), 1), numpy.sort(host, axis=1)),
        "cupy.cumsum": (cupy.cumsum(x, axis=1), numpy.cumsum(host, axis=1)),
        "cupy.bincount": (cupy.bincount(idx, minlength=4), numpy.bincount([2, 0], minlength=4)),
        "numpy.allclose": (numpy.allclose(x, x), True),
        "cupy.asarray of device scalars": (cupy.asarray([x[0, 0], x.sum(), 2.0]), [host[0, 0], host.sum(), 2.0]),
    }
    for what, (got, want) in cases.items():
        assert type(got) is cupy.ndarray and backend.is_device_array(got), what
        assert backend.array_module(got) is cupy, what
        numpy.testing.assert_array_equal(got.get(), want, err_msg=what)
    z = cupy.zeros_like(x)
    assert cupy.multiply(x, 2, out=z) is z and cupy.ascontiguousarray(x) is x and x.astype(x.dtype, copy=False) is x
    y = x.copy()
    y[0] = 7.0                                                           # a write through a view lands in y
    y[:, 0] += 1.0
    assert y.get()[0].tolist() == [8.0, 7.0, 7.0, 7.0] and x.get()[0, 0] == host[0, 0]


@pytest.mark.mpi(min_size=1)
def test_host_reads_uploads_and_pinned_memory_are_counted(cupy):
    import cupyx
    c = standin.counters
    x = cupy.asarray(numpy.arange(6.0))                                  # an upload of 48 bytes
    assert (c.uploads, c.upload_bytes, c.syncs) == (1, 48, 0)
    float(x.sum()), int(x[1]), bool(x[2] > 1), x[3].item(), x.tolist(), cupy.asnumpy(x), x.get()
    cupy.cuda.get_current_stream().synchronize()
    assert c.syncs == 8 and c.sync_reasons["float"] == 1 and c.sync_reasons["stream.synchronize"] == 1
    x[x > 2], cupy.nonzero(x), cupy.bincount(cupy.asarray([1, 3]))     # CuPy's own syncs: sizes from the data
    assert c.syncs == 8 + 1 + 1 + 2 and c.uploads == 2
    assert c.sync_sites[f"{__name__.split('.')[-1]}.py:test_host_reads_uploads_and_pinned_memory_are_counted"] == 12
    x[numpy.array([0, 1])] = numpy.array([5.0, 6.0])                    # host index and values: two uploads
    x.set(numpy.zeros(6))
    assert c.uploads == 5
    n = c.kernels
    x.T, x.reshape(2, 3)                                                 # views: no kernel
    assert c.kernels == n
    x + 1, numpy.exp(x)
    assert c.kernels == n + 2
    buf = cupyx.empty_pinned((4, 8), dtype="f4")
    assert type(buf) is numpy.ndarray and (c.pinned_allocs, c.pinned_bytes, c.pinned_live_bytes) == (1, 128, 128)
    del buf
    gc.collect()
    assert c.pinned_live_bytes == 0 and c.pinned_peak_bytes == 128
    cupyx.scatter_add(x, cupy.asarray([0, 0]), 1.0)                      # floats: atomics
    cupyx.scatter_add(cupy.zeros(3, dtype="i8"), cupy.asarray([1, 1]), 1)
    assert c.atomics == 1 and x.get()[0] == 2.0


def _mpi_cases(cupy):
    return cupy.arange(4.0) * (WORLD.Get_rank() + 1)


@pytest.mark.mpi(min_size=1)
def test_mpi_reads_device_arrays_only_staged(cupy, world):
    x = _mpi_cases(cupy)
    with pytest.raises(TypeError):
        world.Allreduce(MPI.IN_PLACE, x)                                  # not CUDA-aware: refused
    assert standin.counters.mpi_refusals["Allreduce"] == 1 and "not CUDA-aware" in standin.counters.last_refusal
    group = Group(world.Dup(), "dp")
    assert group.all_reduce(x) is x and group.iall_reduce(x).wait() is x      # the collectives stage
    n = world.Get_size()
    assert x.get().tolist() == (numpy.arange(4.0) * (n * (n + 1) // 2) * n).tolist()     # summed twice
    assert standin.counters.mpi_device_buffers == 0 and backend.stager().lent == 0
    group.comm.Free()


@pytest.mark.mpi(min_size=1)
def test_cuda_aware_mpi_takes_device_pointers_outside_nonblocking_collectives(cuda_aware, world):
    x = _mpi_cases(cuda_aware)
    world.Allreduce(MPI.IN_PLACE, x)                                     # blocking: by pointer
    y = cuda_aware.empty_like(x)
    req = world.Isend(x, dest=world.Get_rank(), tag=7)                   # point to point: by pointer
    world.Recv(y, source=world.Get_rank(), tag=7)
    req.Wait()
    assert dict(standin.counters.mpi_device_calls) == {"Allreduce": 1, "Isend": 1, "Recv": 1}
    assert y.get().tolist() == x.get().tolist()
    with pytest.raises(TypeError):
        world.Iallreduce(MPI.IN_PLACE, x)                                # Open MPI 4.x: not by pointer
    assert "non-blocking collective Iallreduce" in standin.counters.last_refusal


def _nonblocking(group, x, what):
    if what == "iall_reduce":
        return group.iall_reduce(x).wait()
    sizes = [x.shape[0]] * group.size
    if what == "iall_gather":
        return group.iall_gather(x, sizes, axis=0).wait()
    return group.ireduce_scatter(x, [x.shape[0] // group.size] * group.size, axis=0).wait()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["iall_reduce", "iall_gather", "ireduce_scatter"])
def test_nonblocking_collectives_under_cuda_aware_mpi(cuda_aware, world, what):
    """Open MPI 4.x takes device buffers in blocking collectives only: a started collective must stage
    (issue 21, finding 1: Iallreduce; the same held for Iallgatherv and Ireduce_scatter)."""
    group = Group(world.Dup(), "dp")
    try:
        x = cuda_aware.arange(8.0).reshape(4, 2) * (group.rank + 1)      # (4, 2)
        out = _nonblocking(group, x, what)
        assert backend.is_device_array(out) and standin.counters.mpi_refusals == {}
    finally:
        group.comm.Free()


@pytest.mark.mpi(min_size=2)
def test_collective_timings_leave_out_the_wait_for_queued_work(cupy, world, monkeypatch):
    """Issue 21, finding 3: a collective's clock started before the wait for the GPU's queued work."""
    monkeypatch.setattr(standin.counters, "wait_seconds", 0.2)      # a sync after queued kernels takes 0.2 s
    group = Group(world.Dup(), "dp")
    try:
        x = cupy.ones(1000) * 2.0                                     # queued work
        group.all_reduce(x)
        took = world.allreduce(group.stats.seconds["dp/all_reduce"], op=MPI.MIN)   # the last rank in waits least
        assert took < 0.1, f"the all-reduce was timed {took:.3f} s, the queued work's 0.2 s included"
    finally:
        group.comm.Free()


@pytest.mark.mpi(min_size=1)
def test_a_gpu_failing_on_one_rank_fails_every_rank_with_its_message(monkeypatch, world):
    """Issue 21, finding 8: backend.use('cupy') agrees over the ranks instead of leaving them in a collective."""
    monkeypatch.setenv("MPI_TP_CUPY_STANDIN", "1")
    last = world.Get_size() - 1
    monkeypatch.setattr(standin.settings, "fail_ranks", {last})
    try:
        with pytest.raises(BackendError) as e:
            backend.use("cupy", world)
        said = str(e.value)
        assert all_true("cudaErrorNoDevice" in said and (f"(rank {last})" in said) == (last > 0), world), said
        assert backend.name() == "numpy" and not standin.installed()
        monkeypatch.setattr(standin.settings, "fail_ranks", set())
        monkeypatch.setattr(standin.settings, "devices", 0)
        with pytest.raises(BackendError, match="CuPy sees no GPU"):
            backend.use("cupy", world)
        monkeypatch.setattr(standin.settings, "devices", 1)
        backend.use("cupy", world)                                      # and then it starts
        assert backend.name() == "cupy" and standin.installed()
    finally:
        backend.use("numpy")


@cli
def test_a_job_whose_rank_1_cannot_start_its_gpu_ends_with_one_message(monkeypatch, tmp_path):
    monkeypatch.setenv("MPI_TP_CUPY_STANDIN", "1")
    monkeypatch.setenv("MPI_TP_CUPY_STANDIN_FAIL_RANKS", "1")
    r = mpirun(2, "train", *TINY, "--backend", "cupy", "--out", str(tmp_path / "run"), timeout=60)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    assert text.count("(rank 1) --backend cupy needs CuPy and a working GPU (CUDARuntimeError") == 1, text
    assert "Traceback" not in text


@cli
def test_a_training_job_runs_on_the_standin(monkeypatch, tmp_path):
    monkeypatch.setenv("MPI_TP_CUPY_STANDIN", "1")
    r = mpirun(2, "train", *TINY, "--backend", "cupy", "--tp", "1", "--dp", "2", "--zero", "1",
               "--out", str(tmp_path / "run"), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "float64 on cupy" in r.stdout and "step 2/2" in r.stdout


@cli
def test_bench_runs_on_the_standin(monkeypatch):
    """Issue 21, finding 4: bench's bare Allreduce handed a CuPy array straight to MPI."""
    monkeypatch.setenv("MPI_TP_CUPY_STANDIN", "1")
    r = mpirun(2, "bench", "--custom", "16,2,1,8,2", "--steps", "1", "--warmup", "0", "--backend", "cupy",
               timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
