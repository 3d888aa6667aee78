"""Activation recomputation: the gradients with --recompute selective or full are bitwise those kept
from the forward pass (float64, dropout on, every tensor-parallel size of the pass, with and without
sequence parallelism), and the activations kept shrink as they should."""
import numpy as np
import pytest

from mpi_tp.core.testing import all_true
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

pytestmark = pytest.mark.mpi(min_size=1)
CFG = GPTConfig(vocab_size=37, block_size=7, n_layer=2, n_head=5, n_embd=20, dropout=0.1)


def step(world, recompute, sp):
    topo = Topology.create(world, tp=world.Get_size())
    model = GPT(CFG, topo, dtype="float64", seed=2, sequence_parallel=sp, recompute=recompute)
    rng = np.random.default_rng(4)
    x, y = rng.integers(0, 37, (3, 7)), rng.integers(0, 37, (3, 7))
    model.zero_grad()
    loss = model.forward(x, y)
    kept = model.activation_bytes()
    model.backward()
    return loss, {p.name: p.grad.copy() for p in model.parameters()}, kept


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputed_gradients_are_bitwise_the_stored_ones(world, mode, sp):
    if sp and world.Get_size() > 7:
        pytest.skip("more ranks than positions")
    loss, grads, kept = step(world, "none", sp)
    loss_r, grads_r, kept_r = step(world, mode, sp)
    same = loss == loss_r and all(np.array_equal(grads[k], grads_r[k]) for k in grads)
    assert all_true(same, world), [k for k in grads if not np.array_equal(grads[k], grads_r[k])]
    assert kept_r < kept


def test_what_full_recomputation_keeps():
    """Full: a block keeps its input only (B, S, C) float64, plus the embedding's and head's caches."""
    world = Topology.serial().world
    _, _, kept = step(world, "full", False)
    _, _, none = step(world, "none", False)
    block_input = 3 * 7 * 20 * 8
    blocks_none = none - kept + 2 * block_input        # what the two blocks kept without recomputation
    assert kept < none and blocks_none > 10 * block_input
