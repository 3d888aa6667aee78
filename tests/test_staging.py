"""GPU staging without a GPU: host buffers lent to MPI for device arrays, one per collective in flight.

A stand-in "device array" (a NumPy array whose type claims to come from CuPy,
with CuPy's .get(out=) / .set() copies) goes through the real Stager and the
real counted collectives, with plain host memory in place of pinned memory.
Two data-parallel buckets of the same size all-reduced concurrently must not
share a staging buffer (they did, when buffers were kept one per shape).
"""
import numpy as np
import pytest

from mpi_tp.core import backend
from mpi_tp.core.gpu import Stager, is_device_array
from mpi_tp.parallel.collectives import Group


class FakeDeviceArray(np.ndarray):
    """Looks like a CuPy array to the stager; its values live in host memory."""

    def get(self, out):
        out[...] = self.view(np.ndarray)
        return out

    def set(self, host):
        self.view(np.ndarray)[...] = host


FakeDeviceArray.__module__ = "cupy._fake"


def device(a):
    return np.ascontiguousarray(a).view(FakeDeviceArray)


def host_stager():
    made = []

    def allocate(shape, dtype):
        made.append(np.empty(shape, dtype))
        return made[-1]
    return Stager(cuda_aware=False, allocate=allocate, synchronize=lambda: None), made


def test_each_lend_gets_its_own_buffer_and_buffers_are_reused():
    stager, made = host_stager()
    a, b = device(np.ones(5)), device(np.full(5, 2.0))
    buf_a, buf_b = stager.lend(a), stager.lend(b)
    assert is_device_array(a) and buf_a is not buf_b and stager.lent == 2
    assert buf_a.tolist() == [1.0] * 5 and buf_b.tolist() == [2.0] * 5
    buf_a[...] = 7
    stager.give_back(a, buf_a)
    stager.give_back(b, buf_b)
    assert a.tolist() == [7.0] * 5 and stager.lent == 0
    stager.lend(device(np.zeros(5)))
    assert len(made) == 2                                   # the pool served it: no new buffer


def test_host_arrays_and_cuda_aware_mpi_pass_through():
    stager, made = host_stager()
    x = np.ones(3)
    assert stager.lend(x) is x
    aware = Stager(cuda_aware=True, synchronize=lambda: None)
    d = device(np.ones(3))
    assert aware.lend(d) is d and aware.give_back(d, d) is d and made == []


@pytest.mark.mpi(min_size=2)
def test_concurrent_allreduces_of_equal_size_stay_apart(world, monkeypatch):
    stager, made = host_stager()
    monkeypatch.setattr(backend, "_stager", stager)
    group = Group(world.Dup(), "dp")
    r, n = world.Get_rank(), world.Get_size()
    buckets = [device(np.full(1000, (k + 1) * (r + 1), dtype="f8")) for k in range(3)]   # equal sizes
    pending = [group.iall_reduce(b) for b in buckets]       # all in flight together, as DP buckets are
    assert stager.lent == 3
    for p in pending:
        p.wait()
    total = n * (n + 1) / 2
    for k, b in enumerate(buckets):
        assert np.array_equal(b.view(np.ndarray), np.full(1000, (k + 1) * total)), f"bucket {k}"
    assert stager.lent == 0 and len(made) == 3
    group.comm.Free()
