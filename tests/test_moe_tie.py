"""Routing decisions are the same on every tensor-parallel rank, even at a near tie their copies of the input
would break differently: each position is routed once, by its owner (mpi_tp.parallel.expert_tokens).

The tie is planted: experts 0 and 1 differ only in channel 0 of the router (by 1e-3), and channel 0 of the
input is +1e-10 on tp rank 0's copy and -1e-10 on the others' (copies that differ in one channel by 2e-10,
as replicas' bits may after reductions done in another order): routed from its own copy, rank 0 would send
every token to expert 1 and the others every token to expert 0. The block must make one decision per token
(the owner's), the same routing on every rank, and the same output bit for bit.

    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_moe_tie.py     (N = 2 .. 4)
"""
import numpy as np
import pytest

from mpi_tp.core.testing import all_true
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.moe import MoEMLP
from mpi_tp.model.routing import route
from mpi_tp.parallel.topology import Topology

pytestmark = pytest.mark.mpi(min_size=2)
B, S, C, E = 2, 9, 16, 4                      # S = 9: uneven positions over 2 and 4 ranks


def test_a_near_tie_is_decided_once(world):
    n = world.Get_size()
    topo = Topology.create(world, tp=n)
    cfg = GPTConfig(vocab_size=37, block_size=S, n_layer=1, n_head=n, n_embd=C, moe_experts=E, moe_top_k=1)
    moe = MoEMLP("h/0/moe", cfg, topo, "float64", seed=3)
    W = moe.router.data
    W[...] = 0.0
    W[1, 0] = W[1, 1] = 1.0                   # z_0 = z_1 = x_1 = 5 (experts 2, 3: 0), but for channel 0:
    W[0, 1] = 1e-3                            # z_1 - z_0 = 1e-3 x_0
    x = np.random.default_rng(0).normal(size=(B, S, C))
    x[..., 1] = 5.0
    x[..., 0] = 1e-10 if topo.tp.rank == 0 else -1e-10        # the copies differ by 2e-10 in channel 0
    own_copy = route(x.reshape(-1, C) @ W, 1).choice.reshape(B, S)
    every = world.allgather(own_copy)
    assert not all(np.array_equal(every[0], e) for e in every[1:]), "the planted tie is not a tie: the test proves nothing"

    y = moe.forward(x)
    choice, _ = moe.routing
    routings, outputs = world.allgather(choice), world.allgather(y)
    assert all_true(all(np.array_equal(routings[0], r) for r in routings), world), "routing differs between tp ranks"
    assert all_true(all(np.array_equal(outputs[0], o) for o in outputs), world), "output differs between tp ranks"
    # each position went where its owner's copy sends it: expert 1 for rank 0's positions, 0 for the others'
    owner = np.concatenate([np.full(k, r) for r, k in enumerate(moe._owners.sizes)])
    assert all_true(np.array_equal(choice[..., 0], np.where(owner == 0, 1, 0)[None, :].repeat(B, 0)), world)
    dx = moe.backward(np.ones_like(y))
    grads = world.allgather(dx)
    assert all_true(all(np.array_equal(grads[0], g) for g in grads), world), "input gradient differs between tp ranks"
    topo.free()
