"""Pipelines with data parallelism overlap the gradient all-reduce with the schedule's last backwards.

A chunk's block gradients are final after its last backward in the stage's action list; the
buckets of those blocks must start their Iallreduce then (GradReducer.chunk), before the engine
returns, and change no number: losses and weights after a few AdamW steps equal those of
overlap=False bitwise (the same sums of the same buffers) and the serial model's to 1e-10
(float64, dropout on). Layouts with dp >= 2 where the world allows (at one rank: dp = 1, no
buckets, the same checks).
"""
import numpy as np
import pytest

from mpi_tp.core.testing import all_true, assert_close, gather_full
from mpi_tp.model.gpt import GPT
from mpi_tp.model.chunks import build_stage
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.topology import Topology
from mpi_tp.parallel.trace import Trace

from steps import node_by_node_calls
from test_pipeline import B, STEPS, cfg, serial, train_stage  # the same model, batches and reference

pytestmark = pytest.mark.mpi(min_size=1)


def layouts(n):
    """(tp, pp, dp) with dp >= 2 (dp = 1 at one rank), tp and pp at most 2."""
    out = [(t, p, n // (t * p)) for t in (1, 2) for p in (1, 2) if n % (t * p) == 0 and n // (t * p) >= 2]
    return out or [(1, 1, 1)]


def pipelined(topo, n_layer, name, micro, virtual, bucket_mb, **reducer_args):
    """STEPS AdamW steps; returns (losses, stage, reducer, started): started[k] is how many dp
    Iallreduces step k had started when the engine returned (the counter counts at the start).
    The last step is traced (topo.stats.trace holds its events afterwards)."""
    stage = build_stage(cfg(n_layer), topo, "float64", 3, False, name, micro, virtual)
    reducer = GradReducer(stage, topo.dp, bucket_mb=bucket_mb, **reducer_args)
    started, run = [], stage.engine.run

    def counted(*args, **kwargs):
        topo.stats.trace = Trace()                       # this step's events (kept until the next one)
        before = topo.stats.calls.get("dp/iall_reduce", 0)
        run(*args, **kwargs)
        started.append(topo.stats.calls.get("dp/iall_reduce", 0) - before)
    stage.engine.run = counted
    return train_stage(stage, topo, reducer, micro), stage, reducer, started


# (schedule, micro-batches (0: the number of stages), chunks per stage, bucket MB): 0.001 MB makes
# a bucket per block; 0.05 MB buckets of two or three blocks, across the chunks of a stage
CASES = [("1f1b", 1, 1, 0.001), ("1f1b", 4, 1, 0.001), ("gpipe", 3, 1, 0.001), ("interleaved", 0, 2, 0.001),
         ("interleaved", 4, 2, 0.05), ("zb-h1", 4, 1, 0.001), ("zb-v", 0, 2, 0.05)]


@pytest.mark.parametrize("name,micro,virtual,bucket_mb", CASES)
def test_overlapped_dp_equals_after_and_serial(world, name, micro, virtual, bucket_mb):
    for tp, pp, dp in layouts(world.Get_size()):
        m = micro or pp
        n_layer = pp * virtual + 1                               # uneven: one chunk holds one more block
        what = f"{name} tp={tp} pp={pp} dp={dp} M={m} V={virtual} bucket_mb={bucket_mb}"
        ref_losses, ref = serial(n_layer, dp * m * B)
        topo = Topology.create(world, tp=tp, pp=pp, dp=dp)
        after_losses, after, reducer, started = pipelined(topo, n_layer, name, m, virtual, bucket_mb, overlap=False)
        assert all_true(started == [0] * STEPS, world), f"overlap=False started buckets in the schedule, {what}"
        losses, stage, reducer, started = pipelined(topo, n_layer, name, m, virtual, bucket_mb)

        # (1) the same numbers: bitwise as overlap=False, the serial model's to 1e-10
        same = np.array_equal(losses, after_losses) and all(
            np.array_equal(p.data, q.data) for p, q in zip(stage.parameters(), after.parameters()))
        assert all_true(same, world), f"overlap changed the numbers, {what}"
        assert_close(losses, ref_losses, 1e-10, f"losses, {what}")
        for p in stage.parameters():
            if p.name.endswith("attn/k/bias"):
                continue    # exact gradient 0: its value is rounding noise (docs/tensor_parallelism.md)
            assert_close(gather_full(p, topo.tp.comm), ref[p.name], 1e-10, f"{p.name}, {what}", comm=topo.tp.comm)

        # (2) every bucket of blocks started before the engine returned, the rest after it
        of_blocks = sum(1 for b in reducer.buckets if b.ready_after is not None)
        assert all_true(dp == 1 or of_blocks >= 1, world), f"no bucket of blocks, {what}"
        assert all_true(started == [of_blocks] * STEPS, world), \
            f"started {started} bucket all-reduces during the schedule, want {of_blocks} per step, {what}"
        assert all_true(topo.stats.calls.get("dp/iall_reduce", 0) == 2 * STEPS * len(reducer.buckets), world)
        # ... and a later chunk's buckets before the stage's chunk 0 ran its last backward (the last step)
        events = topo.stats.trace.events
        topo.stats.trace = None
        if virtual > 1 and dp > 1 and bucket_mb < 0.01:
            first_start = min(e["ts"] for e in events if e["name"] == "dp/iall_reduce")
            chunk0 = max(e["ts"] for e in events if e["name"] == "B" and e["args"]["chunk"] == topo.pp.rank)
            assert all_true(first_start < chunk0, world), f"no bucket started before chunk 0's last backward, {what}"
        topo.free()


def test_hierarchical_reduces_after_the_schedule(world):
    """Hierarchical DP (node by node, blocking) keeps every all-reduce after the schedule: the same
    weights as the serial model's."""
    n = world.Get_size()
    pp = 2 if n % 2 == 0 and n >= 4 else 1
    dp = n // pp
    ref_losses, ref = serial(pp * 2 + 1, dp * pp * B)
    topo = Topology.create(world, tp=1, pp=pp, dp=dp)
    losses, stage, _, started = pipelined(topo, pp * 2 + 1, "interleaved", pp, 2, 0.001, hierarchical=True)
    topo.stats.trace = None
    assert all_true(started == [0] * STEPS and "dp/iall_reduce" not in topo.stats.calls, world)
    assert all_true(node_by_node_calls(topo.stats) > 0 or dp == 1, world), "the gradients were not reduced node by node"
    assert_close(losses, ref_losses, 1e-10, "losses, hierarchical")
    for p in stage.parameters():
        if not p.name.endswith("attn/k/bias"):
            assert_close(p.data, ref[p.name], 1e-10, f"{p.name}, hierarchical", comm=topo.tp.comm)
    topo.free()


@pytest.mark.mpi(min_size=2)
def test_a_bucket_starts_once_all_its_blocks_are_done(world):
    """A bucket of two blocks starts when both are reported, in whichever order (a pipeline stage's
    chunks report their blocks chunk by chunk, as their last backwards come), and only once."""
    topo = Topology.create(world, tp=1, dp=world.Get_size())
    model = GPT(cfg(4), topo, dtype="float64", seed=3)
    reducer = GradReducer(model, topo.dp, bucket_mb=0.05)       # ~40 KB a block: buckets {3, 2}, {1, 0}, the rest
    assert [b.ready_after for b in reducer.buckets] == [2, 0, None]
    view = reducer.chunk(2)                                     # a chunk holding blocks 2 and 3
    calls = []
    for report in (lambda: view.block_done(0), lambda: view.block_done(1), lambda: reducer.block_done(0),
                   lambda: reducer.block_done(0), lambda: reducer.block_done(1), lambda: view.finish()):
        report()
        calls.append(topo.stats.calls.get("dp/iall_reduce", 0))
    reducer.finish()
    assert calls == [0, 1, 1, 1, 2, 2] and topo.stats.calls["dp/iall_reduce"] == 3
    topo.free()
