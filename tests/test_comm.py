"""Collectives and the conjugate regions, checked against closed forms at every world size."""
import numpy as np
import pytest
from mpi4py import MPI

from mpi_tp.core.testing import assert_close
from mpi_tp.parallel import tensor_parallel as C
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.comm_stats import CommStats
from mpi_tp.parallel.topology import Topology, TopologyError, offsets, split_sizes

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture
def group(world):
    return Group(world.Dup(), "tp", CommStats())


def rank_sum(n):
    return n * (n - 1) / 2


def test_all_reduce_sums_ranks(group):
    x = np.ones((3, 4)) * group.rank
    out = group.all_reduce(x)
    assert out is x                                    # in place
    assert_close(x, np.full((3, 4), rank_sum(group.size)), 0, "sum of ranks")


def test_all_reduce_max(group):
    x = np.array([float(group.rank), -float(group.rank)])
    group.all_reduce(x, op=MPI.MAX)
    assert_close(x, np.array([group.size - 1, 0.0]), 0, "max of ranks")


@pytest.mark.parametrize("n", [1, 4, 7, 13])
def test_all_gather_last_uneven(group, n):
    if n < group.size:
        pytest.skip("fewer columns than ranks")
    sizes = split_sizes(n, group.size)
    start = offsets(sizes)[group.rank]
    full = np.arange(2 * 3 * n, dtype=np.float32).reshape(2, 3, n)
    out = group.all_gather_last(np.ascontiguousarray(full[..., start:start + sizes[group.rank]]), sizes)
    assert_close(out, full, 0, f"all-gather of {n} columns")


def test_scatter_gather_round_trip(group):
    sizes = split_sizes(11, group.size)
    x = np.random.default_rng(0).standard_normal((4, 11))
    part = C.scatter_to_tp(x, group, sizes)
    assert part.shape == (4, sizes[group.rank])
    assert_close(C.gather_from_tp(part, group, sizes), x, 0, "gather(scatter(x))")
    # each is the other's backward
    assert_close(C.scatter_to_tp_backward(part, group, sizes), x, 0, "scatter backward")
    assert_close(C.gather_from_tp_backward(x, group, sizes), part, 0, "gather backward")


def test_conjugate_pairs(group):
    x = np.ones(5) * (group.rank + 1)
    assert C.copy_to_tp(x, group) is x                         # f forward: identity
    assert C.reduce_from_tp_backward(x, group) is x            # g backward: identity
    total = rank_sum(group.size) + group.size
    assert_close(C.copy_to_tp_backward(x.copy(), group), np.full(5, total), 0, "f backward")
    assert_close(C.reduce_from_tp(x.copy(), group), np.full(5, total), 0, "g forward")


def test_counters(group):
    group.all_reduce(np.zeros(10, dtype=np.float32))
    group.all_reduce(np.zeros(3, dtype=np.float64))
    group.all_gather_last(np.zeros((2, 1)), [1] * group.size)
    snap = group.stats.snapshot()
    if group.size == 1:
        assert snap == {}                                      # nothing communicated, nothing counted
        return
    assert snap["tp/all_reduce"]["calls"] == 2
    assert snap["tp/all_reduce"]["bytes"] == 10 * 4 + 3 * 8
    assert snap["tp/all_gather"]["calls"] == 1 and snap["tp/all_gather"]["bytes"] == 2 * group.size * 8
    p = group.size
    assert snap["tp/all_reduce"]["wire_bytes"] == round(2 * (40 + 24) * (p - 1) / p)


def test_rejects_non_contiguous(group):
    if group.size == 1:
        pytest.skip("one-rank groups return before any check")
    x = np.zeros((4, 4))[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        group.all_reduce(x)


def test_split_sizes():
    for n in range(1, 30):
        for p in range(1, n + 1):
            s = split_sizes(n, p)
            assert sum(s) == n and max(s) - min(s) <= 1 and s == sorted(s, reverse=True)
    assert split_sizes(5, 2) == [3, 2]
    assert offsets([3, 2, 2]) == [0, 3, 5]


def test_topology_layout(world):
    topo = Topology.create(world)
    assert topo.tp.size == world.Get_size() and topo.dp.size == 1
    assert topo.tp.rank == world.Get_rank()
    with pytest.raises(TopologyError, match="needs"):
        Topology.create(world, tp=world.Get_size() + 1)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_all_gather_and_reduce_scatter_any_axis_uneven(group, axis):
    """Closed forms: gather of rank-tagged shards; reduce-scatter of rank-valued arrays (sum of ranks)."""
    n = 2 * group.size + 1                                   # uneven at every size > 1
    sizes = split_sizes(n, group.size)
    start = offsets(sizes)[group.rank]
    shape = [3, 4, 5]
    shape[axis] = n
    full = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    idx = [slice(None)] * 3
    idx[axis] = slice(start, start + sizes[group.rank])
    assert_close(group.all_gather(np.ascontiguousarray(full[tuple(idx)]), sizes, axis), full, 0, "all-gather")
    mine = group.reduce_scatter(full * (group.rank + 1), sizes, axis)
    total = sum(r + 1 for r in range(group.size))
    assert_close(mine, full[tuple(idx)] * total, 0, "reduce-scatter")
    # all-gather(reduce-scatter(x)) == all-reduce(x)
    again = group.all_gather(mine, sizes, axis)
    assert_close(again, group.all_reduce(full * (group.rank + 1)), 0, "RS + AG = AR")


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_nonblocking_gather_and_reduce_scatter_equal_blocking(group, axis):
    """iall_gather / ireduce_scatter give what the blocking calls give (uneven shards, any axis), leave
    their input untouched, and are counted under their kind with the same bytes.

    The values are small integers, so every sum is exact whatever order the MPI adds in: the standard
    does not promise that a non-blocking reduction adds in the blocking one's order, and at 3 ranks
    Open MPI 5's do not (1.3e-16 apart on normal floats), while MPICH's do."""
    n = 2 * group.size + 1
    sizes = split_sizes(n, group.size)
    shape = [3, 4, 5]
    shape[axis] = sizes[group.rank]
    mine = np.random.default_rng(group.rank).integers(-8, 9, shape).astype("float64")
    before = mine.copy()
    pending = group.iall_gather(mine, sizes, axis, kind="regather")
    gathered = pending.wait()
    assert_close(gathered, group.all_gather(mine, sizes, axis), 0, "iall_gather")
    assert_close(mine, before, 0, "iall_gather's input")
    whole = np.ascontiguousarray(gathered * (group.rank + 1))
    reduced = group.ireduce_scatter(whole, sizes, axis).wait()
    start = sum(sizes[:group.rank])
    closed = np.take(gathered, range(start, start + sizes[group.rank]), axis) * rank_sum(group.size + 1)
    assert_close(reduced, closed, 0, "ireduce_scatter: the sum over ranks of (rank + 1) x the gathered array")
    assert_close(reduced, group.reduce_scatter(whole, sizes, axis), 0, "ireduce_scatter")
    if group.size > 1:
        snap = group.stats.snapshot()
        assert snap["tp/regather"]["calls"] == 1 and snap["tp/regather"]["bytes"] == gathered.nbytes
        assert snap["tp/reduce_scatter"]["calls"] == 2 and snap["tp/reduce_scatter"]["bytes"] == 2 * whole.nbytes


def test_nonblocking_all_reduce(group):
    x = np.full(1000, float(group.rank))
    pending = group.iall_reduce(x)
    while not pending.test():
        pass
    assert pending.wait() is x
    assert_close(x, np.full(1000, rank_sum(group.size)), 0, "iall_reduce")
    if group.size > 1:
        snap = group.stats.snapshot()["tp/iall_reduce"]
        assert snap["calls"] == 1 and snap["bytes"] == 8000


@pytest.mark.mpi(min_size=1)
def test_three_dimensional_grid(world):
    """world rank = (d * pp + p) * tp + t: tp groups consecutive, then pipeline stages, replicas outermost."""
    n, r = world.Get_size(), world.Get_rank()
    for tp in range(1, n + 1):
        for pp in range(1, n // tp + 1):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            topo = Topology.create(world, tp=tp, pp=pp, dp=dp)
            t, p, d = r % tp, (r // tp) % pp, r // (tp * pp)
            assert (topo.tp.rank, topo.pp.rank, topo.dp.rank) == (t, p, d)
            assert topo.tp.comm.allgather(r) == [(d * pp + p) * tp + k for k in range(tp)]
            assert topo.pp.comm.allgather(r) == [(d * pp + k) * tp + t for k in range(pp)]
            assert topo.dp.comm.allgather(r) == [(k * pp + p) * tp + t for k in range(dp)]
            assert topo.layout.to_dict() == {"world": n, "tp": tp, "pp": pp, "dp": dp}
            rows = topo.replica_rows(3)                        # a global batch of dp x 3 rows
            assert rows == slice(3 * d, 3 * d + 3)
            assert sorted({(x.start, x.stop) for x in world.allgather(rows)}) == [(3 * k, 3 * k + 3) for k in range(dp)]
            topo.free()
    with pytest.raises(TopologyError, match="needs"):
        Topology.create(world, tp=1, pp=n + 1, dp=1)


@pytest.mark.mpi(min_size=2)
def test_point_to_point_ring(world):
    """Each rank sends rank-valued arrays to the next and receives the previous one's, two tags in
    flight at once (as a pipeline stage does with activations and gradients); counters count the bytes."""
    from mpi_tp.parallel.collectives import Group
    from mpi_tp.parallel.comm_stats import CommStats
    group = Group(world.Dup(), "pp", CommStats())
    r, n = group.rank, group.size
    out = [np.full((3, 5), 10.0 * r + k) for k in range(2)]
    into = [np.empty((3, 5)) for _ in range(2)]
    pending = [group.irecv(into[k], (r - 1) % n, tag=k) for k in range(2)]
    pending += [group.isend(out[k], (r + 1) % n, tag=k) for k in (1, 0)]      # sent in the other order
    for p in pending:
        p.wait()
    for k in range(2):
        assert np.array_equal(into[k], np.full((3, 5), 10.0 * ((r - 1) % n) + k))
    snap = group.stats.snapshot()
    assert snap["pp/send"]["bytes"] == snap["pp/recv"]["bytes"] == 2 * 15 * 8
    assert snap["pp/send"]["wire_bytes"] == 2 * 15 * 8 and snap["pp/send"]["calls"] == 2
    group.comm.Free()
