"""Mixture of experts on the experts' own grid (mpi_tp.parallel.expert_grid): expert tensor parallelism
(etp apart from tp), experts with context and sequence parallelism, against the serial MoE model on the
same global batch: losses, gradient norms, routing and weights over 5 AdamW steps (float64, 1e-8), with
dropout, capacity dropping, shared experts, both dispatchers.

Megatron-LM #1628: with ep = 1 and etp != tp its expert gradients were summed over the wrong ranks (etp >
tp: other columns of the same expert mixed in; tp > etp: each copy got a part of its gradient and the
copies drifted apart). Here those layouts (tp 2 etp 1 ep 1; tp 1 etp 2 ep 1, and at 3 and 4 ranks) must
give the serial weights, and the copies of each expert shard (edp) must agree bit for bit.

    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_moe_grid.py     (N = 1 .. 4)
"""
import numpy as np
import pytest
from test_moe import B, MOE, STEPS, run
from test_moe import CFG as MOE_CFG

from mpi_tp.core.testing import all_true, assert_close, gather_full, max_rel_diff
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.expert_parallel import expert_of
from mpi_tp.parallel.topology import Topology

pytestmark = pytest.mark.mpi(min_size=1)
CFG = {**MOE_CFG, "n_head": 4}                     # tp up to 4 (3: uneven heads, experts' widths, positions)
NAMES = ["E4-top2", "E3-top2-capacity", "E4-top2-sigmoid-shared", "E3-top2-capacity-allgather"]
# (tp, cp, dp, ep, etp, sp) per world size; etp 0: tp's
GRIDS = {
    1: [(1, 1, 1, 1, 0, False)],
    2: [(2, 1, 1, 1, 1, False),           # #1628, tp > etp: edp is the tp group
        (1, 1, 2, 1, 2, False),           # #1628, etp > tp: one expert split over two replicas
        (2, 1, 1, 2, 1, False),           # the experts divided among the tp ranks
        (2, 1, 1, 2, 1, True),            # ... under sequence parallelism
        (1, 2, 1, 2, 0, False),           # experts with context parallelism
        (1, 2, 1, 1, 0, False)],
    3: [(3, 1, 1, 3, 1, False), (1, 1, 3, 1, 3, False), (3, 1, 1, 1, 1, True), (1, 3, 1, 3, 0, False)],
    4: [(2, 1, 2, 2, 1, False), (2, 2, 1, 2, 2, True), (1, 2, 2, 2, 2, False), (4, 1, 1, 1, 2, False),
        (2, 2, 1, 4, 1, False)],
}


_serial = {}
SERIAL = Topology.serial()


def serial_reference(name, dp):
    if (name, dp) not in _serial:
        model = GPT(GPTConfig(**CFG, **MOE[name]), SERIAL, dtype="float64", seed=3)
        losses, norms, routing = run(model, model.topo, rows=B * dp)
        _serial[name, dp] = losses, norms, routing, {p.name: p.data.copy() for p in model.parameters()}
    return _serial[name, dp]


def full(p, topo):
    """A parameter whole: an expert's from its etp shards, a dense one's from its tp shards."""
    return gather_full(p, (topo.etp if expert_of(p) is not None else topo.tp).comm)


@pytest.mark.parametrize("name", NAMES)
def test_expert_grid_layouts_equal_serial(world, name):
    for tp, cp, dp, ep, etp, sp in GRIDS[world.Get_size()]:
        if ep > MOE[name]["moe_experts"]:
            continue                                   # refused: tests/test_moe.py
        what = f"{name} at tp={tp} cp={cp} dp={dp} ep={ep} etp={etp or tp}{' sp' if sp else ''}"
        topo = Topology.create(world, tp=tp, cp=cp, dp=dp, ep=ep, etp=etp)
        model = GPT(GPTConfig(**CFG, **MOE[name]), topo, dtype="float64", seed=3, sequence_parallel=sp)
        losses, norms, routing = run(model, topo, rows=B)
        ref_losses, ref_norms, ref_routing, ref_weights = serial_reference(name, dp)
        assert_close(losses, ref_losses, 1e-8, f"loss curve, {what}")
        assert_close(norms, ref_norms, 1e-8, f"gradient norms, {what}")
        mine = topo.replica_rows(B)
        same = all(np.array_equal(c, rc[mine]) and np.array_equal(a, ra[mine])
                   for step, ref_step in zip(routing, ref_routing) for (c, a), (rc, ra) in zip(step, ref_step))
        assert all_true(same, world), f"routing or dropped assignments differ from serial, {what}"
        bad = [f"{p.name}: {max_rel_diff(full(p, topo), ref_weights[p.name]):.2e}"
               for p in model.parameters() if not p.name.endswith("attn/k/bias")    # exact gradient 0
               and max_rel_diff(full(p, topo), ref_weights[p.name]) > 1e-8]
        assert all_true(not bad, world), f"weights after {STEPS} steps differ from serial, {what}: {bad}"
        # the copies of each expert shard agree bit for bit (#1628's symptom), and the grid is the one asked
        same = all(np.array_equal(topo.edp.comm.bcast(p.data, root=0), p.data)
                   for p in model.parameters() if expert_of(p) is not None)
        assert all_true(same, world), f"the copies of an expert shard differ, {what}"
        grid = (topo.etp.size, topo.ep.size, topo.edp.size)
        assert grid == (etp or tp, ep, tp * cp * dp // ((etp or tp) * ep)), f"expert grid {grid}, {what}"
        topo.free()
