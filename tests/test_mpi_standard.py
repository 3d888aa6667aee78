"""What mpi_tp asks of MPI is what the MPI standard promises, not what one library happens to answer.

The standard attaches MPI_TAG_UB (and the other predefined attributes) to MPI_COMM_WORLD; a
communicator made from it by Split, Create_cart, Sub or Dup need not answer. Open MPI 5 answers
None there, MPICH answers everywhere, so code that asked a group's communicator passed under MPICH
and crashed every pipeline run under Open MPI (issue 35). `Strict` wraps a communicator so that it,
and every communicator made from it, answers no attribute at all (stricter than either library:
the world it wraps answers none either); the code must then read them from MPI.COMM_WORLD itself
(mpi_tp.parallel.collectives.tag_limit). The tests run the pipeline engine and whole training runs
on such communicators, under whichever MPI the suite runs with.

The other behaviours the code relies on, and where the standard says so (checked by the suite
under both MPICH and Open MPI: tests/run.sh): receives withdrawn by MPI_Cancel complete
(test_pipeline_engine); one thread calls MPI (the server's scheduler thread, the run lock's heartbeat
touches a file only); error handlers are inherited by derived communicators (mpi4py sets
ERRORS_RETURN on the world); non-blocking reductions may add in another order than blocking ones
(test_comm compares them on sums that are exact in any order); CUDA-awareness is asked of the
library's MPIX_Query_cuda_support, which both export, and can be overridden (mpi_tp.core.gpu).
"""
import os

import pytest
from mpi4py import MPI
from test_pipeline_engine import SHAPE, check_ends, toy

from mpi_tp.parallel.collectives import TAG_UB_MINIMUM, tag_limit
from mpi_tp.parallel.pipeline.engine import PipelineEngine
from mpi_tp.parallel.pipeline.schedules import schedule
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.config import TrainConfig
from mpi_tp.training.loop import train

pytestmark = pytest.mark.mpi(min_size=1)
MAKERS = {"Split", "Split_type", "Create_cart", "Sub", "Dup", "Create", "Create_group"}


class Strict:
    """A communicator that answers None to every Get_attr, as are the ones it makes (Split, Sub, ...)."""

    def __init__(self, comm):
        self._comm = comm
        self.asked = []                          # the attribute keys asked of this communicator

    def Get_attr(self, key):
        self.asked.append(key)
        return None

    def __getattr__(self, name):
        value = getattr(self._comm, name)
        if name in MAKERS:
            return lambda *a, **k: Strict(value(*a, **k))
        return value

    def __eq__(self, other):                     # `comm in (MPI.COMM_SELF, MPI.COMM_NULL)` sees the handle
        return self._comm == getattr(other, "_comm", other)     # (and, as an mpi4py Comm, it is unhashable)


def test_the_strict_communicator_answers_nothing(world):
    strict = Strict(world)
    sub = strict.Split(0, key=world.Get_rank())
    assert isinstance(sub, Strict) and sub.Get_attr(MPI.TAG_UB) is None and sub.Get_size() == world.Get_size()
    sub.Free()
    assert sub == MPI.COMM_NULL and TAG_UB_MINIMUM <= tag_limit() == world.Get_attr(MPI.TAG_UB)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2)])
def test_the_pipeline_engine_on_communicators_that_answer_no_attribute(world, name, v):
    """The engine checks its tags against MPI's limit: the world's attribute, not the group's (on Open MPI
    the group's answer is None, and this failed with a TypeError before the fix)."""
    topo = Topology.create(Strict(world), tp=1, pp=world.Get_size(), dp=1)
    P, s, M = topo.pp.size, topo.pp.rank, 2 * topo.pp.size
    engine = PipelineEngine(topo.pp, schedule(name, P, M, v)[s], v)
    forward, backward, _, out = toy(engine, P)
    engine.run(forward, backward, SHAPE, "float64")
    asked = topo.pp.comm.asked
    topo.free()
    assert asked == [], "the engine asked its group's communicator for an attribute"
    check_ends(out, s, P, v, M)


def layouts(n):
    """Pipelined layouts of n ranks: every rank a stage, and tp 2 x pp 2 (x dp) where it fits."""
    return ([dict(pp=n)] if n > 1 else []) + ([dict(tp=2, pp=2, dp=n // 4)] if n % 4 == 0 else [])


@pytest.mark.parametrize("which", [0, 1])
def test_training_on_communicators_that_answer_no_attribute(world, tmp_path, which):
    """train() on a world whose every communicator answers no attribute: the same losses, bit for bit,
    as on the world itself (a pipelined layout, checkpoint saved at the end)."""
    if which >= len(layouts(world.Get_size())):
        pytest.skip(f"{len(layouts(world.Get_size()))} pipelined layout(s) at {world.Get_size()} rank(s)")
    layout = layouts(world.Get_size())[which]
    where = world.bcast(str(tmp_path) if world.Get_rank() == 0 else None)
    got = {}
    for name, comm in (("world", world), ("strict", Strict(world))):
        cfg = TrainConfig(n_layer=2 * layout["pp"], n_head=2, n_embd=16, block_size=8, batch_size=2, steps=2,
                          micro_batches=2, dtype="float64", sample_len=0, eval_batches=1, log_every=1,
                          out=os.path.join(where, name), **layout)
        record = train(cfg, comm)
        got[name] = (record["final_train_loss"], record["final_val_loss"], record["layout"])
    assert got["strict"] == got["world"] and got["world"][2]["pp"] == layout["pp"] > 1
