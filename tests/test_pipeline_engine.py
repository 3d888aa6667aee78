"""The pipeline engine alone (mpi_tp.parallel.pipeline.engine), on a toy model: every schedule moves
the right message to the right action with any number of receives posted ahead (0, the blocking
engine; 1; 2; more than the actions), receives are posted before the actions ahead of theirs compute,
and a run that fails part-way withdraws the receives it posted.

The toy model: message (3,) float64; global chunk g's forward is y = 2 x + g + 1 (the first chunk
starts from x = [m, m + 1, m + 2] for micro-batch m), its backward dx = 3 dy - g (the last chunk
starts from dy = the output of its forward); the numbers at the ends are checked against the chain
computed serially."""
import time

import numpy as np
import pytest

from mpi_tp.parallel.pipeline.actions import chunk_owner
from mpi_tp.parallel.pipeline.engine import PipelineEngine
from mpi_tp.parallel.pipeline.schedules import (
    SPLIT,
    V_SHAPED,
    Action,
    global_chunk,
    schedule,
)
from mpi_tp.parallel.topology import Topology

pytestmark = pytest.mark.mpi(min_size=1)
SHAPE = (3,)


def serial_chain(m, chunks):
    """What the last chunk computes for micro-batch m, and the gradient the first chunk returns."""
    x = np.array([m, m + 1, m + 2], dtype="float64")
    for g in range(chunks):
        x = 2 * x + g + 1
    dy = x.copy()
    for g in reversed(range(chunks)):
        dy = 3 * dy - g
    return x, dy


def check_ends(out, s, P, v, M, v_shape=False):
    """On the stage that holds it: the last chunk's outputs and the first chunk's gradients equal the
    serial chain's, for micro-batches 0 .. M - 1; every W ran once, after its B."""
    for m in range(M):
        y, dx = serial_chain(m, P * v)
        if s == chunk_owner(P * v - 1, P, v_shape):
            np.testing.assert_array_equal(out["y", m], y)
        if s == 0:
            np.testing.assert_array_equal(out["dx", m], dx)
    for m, c in out.get("W", []):
        assert ("B", m, c) in out["done"] and out["W"].count((m, c)) == 1


def toy(engine, P):
    """(forward, backward, weights, out): out["y", m] the last chunk's output, out["dx", m] the first's
    gradient, out["W"] the W actions run, out["done"] the backwards run."""
    last, out, held = engine.last, {"done": set()}, {}

    def forward(m, c, x):
        g = global_chunk(engine.s, c, P, engine.v_shape)
        assert (x is None) == (g == 0)
        x = np.array([m, m + 1, m + 2], dtype="float64") if g == 0 else x
        y = 2 * x + g + 1
        held[m, c] = y
        if g == last:
            out["y", m] = y
            return None
        return y

    def backward(m, c, dy):
        out["done"].add(("B", m, c))
        g = global_chunk(engine.s, c, P, engine.v_shape)
        assert (dy is None) == (g == last)
        dy = held.pop((m, c)) if g == last else dy
        dx = 3 * dy - g
        if g == 0:
            out["dx", m] = dx
            return None
        return dx

    def weights(m, c):
        out.setdefault("W", []).append((m, c))
    return forward, backward, weights, out


PLANS = [("gpipe", 1, 1), ("gpipe", 3, 1), ("1f1b", 1, 1), ("1f1b", 4, 1), ("interleaved", 2, 2),
         ("interleaved", 4, 3), ("zb-h1", 4, 1), ("zb-v", 1, 2), ("zb-v", 3, 2)]
# (schedule, micro-batches per stage count, chunks per stage)


@pytest.mark.parametrize("prepost", [0, 1, 2, 1000])
@pytest.mark.parametrize("name,per,v", PLANS)
def test_every_schedule_delivers_with_receives_posted_ahead(world, name, per, v, prepost):
    """The ends of the chain equal the serial chain; receive k is posted before action
    max(0, k - prepost) computes (prepost 1000: every receive before the first action)."""
    topo = Topology.create(world, tp=1, pp=world.Get_size(), dp=1)
    P, s = topo.pp.size, topo.pp.rank
    M = per * P if name == "interleaved" else per
    actions, v_shape = schedule(name, P, M, v)[s], name in V_SHAPED
    engine = PipelineEngine(topo.pp, actions, v, prepost=prepost, v_shape=v_shape)
    runs = []
    for step in range(2):                       # twice: nothing left over between runs; checked after both,
        forward, backward, weights, out = toy(engine, P)     # so that a failed check on one rank cannot hang
        topo.stats.reset()
        engine.run(forward, backward, SHAPE, "float64", weights=weights)
        runs.append((out, list(engine.posts), topo.stats.snapshot().get("pp/send", {}).get("calls", 0)))
    topo.free()
    needs = [k for k, a in enumerate(actions) if engine._receive(a) not in (None,) and engine._receive(a)[0] != s]
    mine = [global_chunk(s, c, P, v_shape) for c in range(v)]        # messages: each chunk boundary another rank
    sends = M * sum((g < P * v - 1 and chunk_owner(g + 1, P, v_shape) != s) + (g > 0 and chunk_owner(g - 1, P, v_shape) != s)
                    for g in mine)                                   # holds, once a micro-batch each way
    for out, posts, sent in runs:
        check_ends(out, s, P, v, M, v_shape)
        assert len(out.get("W", [])) == (M * v if name in SPLIT else 0)
        assert sent == sends, (sent, sends)
        assert sorted(k for k, _ in posts) == needs
        assert all(j == max(0, k - prepost) for k, j in posts), posts
        if prepost > 0:
            assert all(j < k for k, j in posts if k > 0)             # posted before the action ahead computed


@pytest.mark.parametrize("prepost", [0, 2, 1000])
def test_forward_only(world, prepost):
    """Evaluation's list (forwards alone, a list passed to run) with receives posted ahead."""
    topo = Topology.create(world, tp=1, pp=world.Get_size(), dp=1)
    P, s, v, M = topo.pp.size, topo.pp.rank, 2, 3
    engine = PipelineEngine(topo.pp, schedule("interleaved", P, P, v)[s], v, prepost=prepost)
    forward, _, _, out = toy(engine, P)
    engine.run(forward, None, SHAPE, "float64", actions=engine.forward_only(M))
    if s == (P * v - 1) % P:
        for m in range(M):
            np.testing.assert_array_equal(out["y", m], serial_chain(m, P * v)[0])
    topo.free()


def test_prepost_from_the_environment(world, monkeypatch):
    topo = Topology.create(world, tp=1, pp=world.Get_size(), dp=1)
    plan = schedule("1f1b", topo.pp.size, 2)[topo.pp.rank]
    monkeypatch.setenv("MPI_TP_PIPE_PREPOST", "0")
    assert PipelineEngine(topo.pp, plan).prepost == 0
    monkeypatch.delenv("MPI_TP_PIPE_PREPOST")
    assert PipelineEngine(topo.pp, plan).prepost == 2
    topo.free()


@pytest.mark.mpi(min_size=2)
def test_a_failed_run_withdraws_its_receives(world):
    """Stage 0 posts the receive of B0's gradient ahead, then its forward raises: the receive is
    cancelled, so the gradient message sent afterwards reaches a fresh receive, not the stale one."""
    topo = Topology.create(world, tp=1, pp=world.Get_size(), dp=1)
    s = topo.pp.rank
    engine = PipelineEngine(topo.pp, [Action("F", 0), Action("B", 0)], prepost=1)
    tag = engine._tag(0, 0, 1)                                        # B0's gradient, for stage 0
    if s == 0:
        def forward(m, c, x):
            raise RuntimeError("the forward failed")
        with pytest.raises(RuntimeError):
            engine.run(forward, None, SHAPE, "float64")
    world.Barrier()
    arrived = True
    if s == 1:
        topo.pp.isend(np.full(SHAPE, 7.0), 0, tag).wait()
    if s == 0:
        fresh = topo.pp.irecv(np.zeros(SHAPE), 1, tag)
        deadline = time.monotonic() + 10
        while not fresh.test() and time.monotonic() < deadline:
            time.sleep(0.001)
        arrived = fresh.test()
    world.Barrier()                                                   # both ranks here, pass or fail
    assert arrived, "the message went to the receive of the failed run"
    assert engine.posts == ([(1, 0)] if s == 0 else [])                # B0's receive had been posted ahead
    if s == 0:
        np.testing.assert_array_equal(fresh.x, np.full(SHAPE, 7.0))
    topo.free()
