"""Gradient accumulation: several backward passes before one zero_grad give the gradients of their sum.

This is what micro-batches (and the pipeline schedules) rely on. Under
sequence parallelism a replicated parameter's gradient (Param.sp_partial) is
this rank's positions' part, accumulated over the micro-batches and summed
over the tensor-parallel group once, after the last one (finalize_grads): one
all-reduce per step whatever the number of micro-batches, and no micro-batch
counted twice. float64, against the serial model on the same weights, at
every tensor-parallel size the pass runs.
"""
import numpy as np
import pytest

from mpi_tp.core.testing import assert_close, gather_full, randomize
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.finalize import finalize_grads
from mpi_tp.parallel.topology import Topology

pytestmark = pytest.mark.mpi(min_size=1)
CFG = GPTConfig(vocab_size=37, block_size=7, n_layer=2, n_head=4, n_embd=16)   # S = 7: uneven at 2, 3, 4


def micro_batches(n):
    rng = np.random.default_rng(11)
    return [(rng.integers(0, 37, (2, 7)), rng.integers(0, 37, (2, 7))) for _ in range(n)]


def accumulated_grads(model, batches, scale):
    model.zero_grad()
    for x, y in batches:
        model.forward(x, y)
        model.backward(dout=scale)
    finalize_grads(model)
    return model


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("n_micro", [1, 3])
def test_accumulated_gradients_equal_serial(world, sequence_parallel, n_micro):
    batches = micro_batches(n_micro)
    serial = GPT(CFG, Topology.serial(), dtype="float64", seed=5)
    randomize(serial, seed=9)
    accumulated_grads(serial, batches, 1.0 / n_micro)
    ref = {p.name: p.grad.copy() for p in serial.parameters()}

    topo = Topology.create(world, tp=world.Get_size())
    model = GPT(CFG, topo, dtype="float64", seed=5, sequence_parallel=sequence_parallel)
    randomize(model, seed=9)
    accumulated_grads(model, batches, 1.0 / n_micro)
    sums = topo.stats.calls.get("tp/sp_grad_all_reduce", 0)
    assert sums == (1 if sequence_parallel and topo.tp.size > 1 else 0), f"{sums} sums of the replicated gradients"
    scale = max(float(np.abs(g).max()) for g in ref.values())      # attn/k/bias: exact gradient 0
    for p in model.parameters():
        assert_close(gather_full(p, topo.tp.comm, "grad"), ref[p.name], 1e-10,
                     f"{p.name} grad after {n_micro} micro-batches (sp={sequence_parallel})", scale=scale)
    topo.free()


def test_accumulation_equals_one_big_batch(world):
    """Two micro-batches of 2 sequences, each scaled 1/2, give the gradient of the batch of 4."""
    (x1, y1), (x2, y2) = micro_batches(2)
    topo = Topology.create(world, tp=world.Get_size())
    big = GPT(CFG, topo, dtype="float64", seed=5, sequence_parallel=True)
    big.zero_grad()
    big.forward(np.concatenate([x1, x2]), np.concatenate([y1, y2]))
    big.backward()
    finalize_grads(big)
    small = accumulated_grads(GPT(CFG, topo, dtype="float64", seed=5, sequence_parallel=True),
                              [(x1, y1), (x2, y2)], 0.5)
    scale = max(float(np.abs(p.grad).max()) for p in big.parameters())
    for p, q in zip(small.parameters(), big.parameters()):
        assert_close(p.grad, q.grad, 1e-12, f"{p.name}: 2 micro-batches vs one batch", scale=scale, comm=topo.tp.comm)
    topo.free()
