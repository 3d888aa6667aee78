"""Hierarchical all-reduce equals the flat one, on emulated nodes (MPI_TP_FAKE_NODES)."""
import numpy as np
import pytest
from steps import node_by_node_calls

from mpi_tp.core.testing import all_true, assert_close
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.comm_stats import CommStats
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.finalize import finalize_grads
from mpi_tp.parallel.hierarchical import HierarchicalAllReduce
from mpi_tp.parallel.topology import Topology

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture(params=[1, 2, 4])
def fake_nodes(request, monkeypatch, world):
    if request.param > world.Get_size():
        pytest.skip("more emulated nodes than ranks")
    monkeypatch.setenv("MPI_TP_FAKE_NODES", str(request.param))
    return request.param


def test_matches_flat(world, fake_nodes):
    group = Group(world.Dup(), "dp", CommStats())
    h = HierarchicalAllReduce(group)
    if world.Get_size() > 1:
        assert h.nodes == fake_nodes
    x = np.full(1001, float(group.rank + 1))                  # closed form: 1 + 2 + ... + n
    h.all_reduce(x)
    assert_close(x, np.full(1001, group.size * (group.size + 1) / 2), 0, "sum of ranks")
    rng = np.random.default_rng(group.rank)
    a = rng.standard_normal((37, 11))
    flat = group.all_reduce(a.copy())
    assert_close(h.all_reduce(a.copy()), flat, 1e-14, "hierarchical vs flat")
    if group.size > 1 and fake_nodes > 1:
        snap = group.stats.snapshot()
        # the network sees one rank per node: only the nodes' first ranks take part in the inter step
        assert ("dp_inter/all_reduce" in snap) == (h.leaders is not None)
    h.free()


def test_training_with_hierarchical_dp(world, fake_nodes):
    """A data-parallel step with node-by-node gradient reduction gives the flat result."""
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=1, n_head=2, n_embd=8)
    rng = np.random.default_rng(world.Get_rank())
    x, y = rng.integers(0, 37, (2, 8)), rng.integers(0, 37, (2, 8))
    grads = []
    for hier in (False, True):
        topo = Topology.create(world, tp=1, dp=world.Get_size())
        model = GPT(cfg, topo, dtype="float64", seed=1)
        reducer = GradReducer(model, topo.dp, bucket_mb=0.001, hierarchical=hier)
        model.forward(x, y)
        model.backward(reducer=reducer)
        finalize_grads(model, reducer)
        grads.append([p.grad.copy() for p in model.parameters()])
        if world.Get_size() > 1:        # the hierarchical step went node by node; the flat one did not
            assert all_true((node_by_node_calls(topo.stats) > 0) == hier, world), (hier, dict(topo.stats.calls))
    for a, b in zip(*grads):
        assert_close(b, a, 1e-13, "gradient")
