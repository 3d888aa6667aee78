"""GPU staging without a GPU: host buffers lent to MPI for device arrays, one per collective in flight.

A stand-in "device array" (a NumPy array whose type claims to come from CuPy,
with CuPy's .get(out=) / .set() copies) goes through the real Stager and the
real counted collectives, with plain host memory in place of pinned memory.
Two data-parallel buckets of the same size all-reduced concurrently must not
share a staging buffer (they did, when buffers were kept one per shape).
"""
import numpy as np
from mpi4py import MPI
import pytest

from mpi_tp.core import backend
from mpi_tp.core.gpu import Stager, is_device_array
from mpi_tp.parallel.collectives import Group


class FakeDeviceArray(np.ndarray):
    """Looks like a CuPy array to the stager; its values live in host memory."""

    def get(self, out, stream=None, blocking=True):
        out[...] = self.view(np.ndarray)
        return out

    def set(self, host, stream=None):
        self.view(np.ndarray)[...] = host


class HostEvent:
    """A copy on the host is over when it returns: its event is done."""
    done = True

    def synchronize(self):
        pass


class HostStreams:
    def new(self):
        return self

    def current(self):
        return self

    def event(self, stream):
        return HostEvent()

    def wait_event(self, event):
        pass


FakeDeviceArray.__module__ = "cupy._fake"


def device(a):
    return np.ascontiguousarray(a).view(FakeDeviceArray)


def host_stager():
    made = []

    def allocate(shape, dtype):
        made.append(np.empty(shape, dtype))
        return made[-1]
    return Stager(cuda_aware=False, allocate=allocate, synchronize=lambda: None, streams=HostStreams()), made


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


@pytest.mark.mpi(min_size=2)            # at one rank a collective returns before the stager sees it
def test_non_blocking_collectives_are_staged_even_with_a_cuda_aware_mpi(world, monkeypatch):
    """Issue 21, finding 1: Open MPI 4.x says it is CUDA-aware, and takes device buffers in point-to-point and
    blocking collectives only. An Iallreduce, Iallgatherv or Ireduce_scatter gets a host copy unless the
    user says the MPI takes them (MPI_TP_CUDA_AWARE_NONBLOCKING=1); a blocking all-reduce and a send
    still hand the device array itself."""
    seen = []
    group = Group(world.Dup(), "dp")
    for flag, staged in ((None, True), (True, False)):
        stager = Stager(cuda_aware=True, allocate=lambda s, d: np.empty(s, d), synchronize=lambda: None,
                        device_nonblocking=flag, streams=HostStreams())
        monkeypatch.setattr(backend, "_stager", stager)
        x = device(np.full(8, float(world.Get_rank())))
        lend = stager.lend

        def spy(a, *args, lend=lend, **kw):
            buf = lend(a, *args, **kw)
            seen.append((kw.get("nonblocking", False), buf is a))
            return buf
        monkeypatch.setattr(stager, "lend", spy)
        seen.clear()
        group.iall_reduce(x).wait()
        assert np.array_equal(x.view(np.ndarray), np.full(8, sum(range(world.Get_size())), dtype=float))
        assert seen and seen[0] == (True, not staged), (flag, seen)
        seen.clear()
        group.all_reduce(device(np.ones(4)))
        assert seen[0] == (False, True)                      # blocking: the device array itself
    group.comm.Free()


def test_the_pool_is_bounded_under_varying_shapes():
    """Issue 21, finding 2: an all-to-all whose row count changes every step and layer (MoE) must reuse a
    few pinned buffers (size classes), and idle pinned memory stays under the limit."""
    made = []
    stager = Stager(cuda_aware=False, allocate=lambda s, d: made.append(np.empty(s, d)) or made[-1],
                    synchronize=lambda: None, limit=4 << 20)
    rng = np.random.default_rng(0)
    for step in range(300):
        rows = int(rng.integers(1, 2000))
        x = device(rng.standard_normal((rows, 64)))          # up to 1 MiB
        y = device(np.empty_like(x.view(np.ndarray)))
        send, recv = stager.lend(x), stager.lend(y, copy=False)
        recv[...] = send
        stager.give_back(x, send, copy=False)
        stager.give_back(y, recv)
        assert np.array_equal(y.view(np.ndarray), x.view(np.ndarray))
        assert stager.idle_bytes() <= 4 << 20
    assert stager.allocated <= 2 * 9, stager.allocated         # two per size class at most, 4 KiB ... 1 MiB
    assert stager.pinned_bytes == stager.idle_bytes() <= 4 << 20


def test_a_collectives_clock_starts_after_the_device_work(monkeypatch):
    """Issue 21, finding 3: the stream is synchronised before a collective's clock starts, so its seconds
    do not include the compute still queued on the GPU."""
    events = []
    stager = Stager(cuda_aware=True, synchronize=lambda: events.append("sync"))
    monkeypatch.setattr(backend, "_stager", stager)
    import mpi_tp.parallel.collectives as collectives
    clock = collectives.time.perf_counter
    monkeypatch.setattr(collectives.time, "perf_counter", lambda: events.append("clock") or clock())
    group = Group(MPI.COMM_SELF.Dup(), "tp")
    group.size = 2                                             # take the counted path (COMM_SELF does one rank)
    group.all_reduce(device(np.ones(4)))
    assert events[:2] == ["sync", "clock"], events
    group.comm.Free()


@pytest.mark.mpi(min_size=2)            # at one rank a collective returns before the stager sees it
def test_a_started_collective_never_blocks_the_host_until_wait(world, monkeypatch):
    """Issue 21, finding 6: the data-parallel buckets start and test their all-reduces inside the backward
    pass; a stream synchronisation or a blocking copy there would stall the GPU's queue. Starting and
    testing copy on the copy stream only; wait() is where the host may block."""
    blocking = []

    class Counting(FakeDeviceArray):
        def get(self, out, stream=None, blocking=True):
            if blocking:
                blocking_calls.append("get")
            return FakeDeviceArray.get(self, out)

        def set(self, host, stream=None):
            if stream is None:
                blocking_calls.append("set")
            FakeDeviceArray.set(self, host)
    Counting.__module__ = "cupy._fake"
    blocking_calls = blocking
    stager = Stager(cuda_aware=False, allocate=lambda s, d: np.empty(s, d), streams=HostStreams(),
                    synchronize=lambda: blocking.append("stream synchronize"))
    monkeypatch.setattr(backend, "_stager", stager)
    group = Group(world.Dup(), "dp")
    x = np.full(64, float(world.Get_rank() + 1)).view(Counting)
    pending = group.iall_reduce(x)
    while not pending.test():
        pass
    assert blocking == [], blocking
    pending.wait()
    n = world.Get_size()
    assert np.array_equal(x.view(np.ndarray), np.full(64, n * (n + 1) / 2)) and stager.lent == 0
    group.comm.Free()
