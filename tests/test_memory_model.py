"""The planner's memory per rank (mpi_tp.planning.memory) against what a real run keeps, at small shapes and
every layout of the pass: weights and gradients, the optimizer's state (the distributed optimizer's share
included), the activations of one micro-batch (sequence parallelism, dropout), and a pipeline stage's peak
under 1F1B, in fp32 and in bf16 (2-byte values and gradients, fp32 masters and moments and per-row
statistics: `mpi-tp plan --precision bf16`). Sizes divide by 1 ... 4, so the shares are even and the counts
exact.

    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_memory_model.py   (N = 1 .. 4)
"""
import numpy as np
import pytest

from mpi_tp.core.testing import all_true
from mpi_tp.model.chunks import build_stage
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.topology import Topology
from mpi_tp.planning.costmodel import Plan, Workload
from mpi_tp.planning.machines import Machine, with_precision
from mpi_tp.planning.memory import memory_per_rank
from mpi_tp.training.optim import AdamW
from mpi_tp.training.step import forward_backward

pytestmark = pytest.mark.mpi(min_size=1)
L, C, H, S, V, B = 4, 24, 12, 12, 48, 2
CPU = Machine(name="test", ranks_per_node=4, gemm_flops=1e11, elem_rate=1e9, mem_bw=1e10, mem_bytes=1e10,
              intra_alpha=1e-5, intra_bw=1e10, inter_alpha=1e-4, inter_bw=1e9)


def layouts(n):
    return [(t, n // t) for t in range(1, n + 1) if n % t == 0]


def state_bytes(params, opt):
    """(weights + gradients, optimizer state) that this rank keeps, each storage once."""
    stores = {id(p.base): p for p in params}.values()
    grads = sum(p.base.nbytes for p in stores)
    if opt.reducer is not None:                          # the distributed optimizer's gradient share
        grads += sum(b.grad_share.nbytes for b in opt.reducer.buckets)
    return grads + sum(p.base.nbytes for p in stores), sum(a.nbytes for arrays in opt.state.values() for a in arrays)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_memory_per_rank_equals_a_real_runs(world, dropout, precision):
    bad, machine = [], with_precision(CPU, precision)
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[precision]
    for tp, dp in layouts(world.Get_size()):
        for sp, zero in ((False, False), (True, dp > 1)):
            topo = Topology.create(world, tp=tp, dp=dp)
            cfg = GPTConfig(vocab_size=V, block_size=S, n_layer=L, n_head=H, n_embd=C, dropout=dropout)
            model = GPT(cfg, topo, dtype=dtype, sequence_parallel=sp)
            reducer = GradReducer(model, topo.dp, distributed=zero)
            opt = AdamW(model.parameters(), reducer=reducer)
            x = np.zeros((B, S), dtype=np.int64)
            model.forward(x, x)
            acts = sum(block.activation_bytes() for block in model.h)
            weights_grads, optimizer = state_bytes(model.parameters(), opt)
            w = Workload(L, C, H, S, global_batch=B * dp, vocab=V, dropout=dropout > 0)
            mem = memory_per_rank(machine, w, Plan(tp=tp, dp=dp, micro_batch=B, sp=sp, zero=int(zero)))
            what = f"tp={tp} dp={dp} sp={sp} zero={zero}"
            bad += [] if acts == mem["activations"] else [(what, "activations", acts, mem["activations"])]
            # a bucket's n elements split over D ranks: the shares differ by one element at most
            share = 4 * len(reducer.buckets) if zero else 0
            bad += [] if abs(weights_grads - mem["weights_grads"]) <= share else [(what, "weights", weights_grads,
                                                                                    mem["weights_grads"])]
            bad += [] if abs(optimizer - mem["optimizer"]) <= 3 * share else [(what, "optimizer", optimizer,
                                                                                mem["optimizer"])]
            topo.free()
    assert all_true(not bad, world), bad


def test_a_pipeline_stages_peak_activations(world):
    """1F1B keeps min(P, M) micro-batches on stage 0: the planner's count is the stage's measured peak
    (its blocks; the embedding's and the loss's arrays are the 'logits' term, not counted here)."""
    P = world.Get_size()
    if P < 2:
        pytest.skip("one stage: no pipeline")
    M = 4
    topo = Topology.create(world, tp=1, pp=P, dp=1)
    cfg = GPTConfig(vocab_size=V, block_size=S, n_layer=2 * P, n_head=H, n_embd=C)
    stage = build_stage(cfg, topo, "float32", 0, False, "1f1b", M)
    for c in stage.chunks:                     # measure the blocks alone: their caches, micro-batch by micro-batch
        c.activation_bytes = (lambda chunk: lambda: sum(b.activation_bytes() for b in chunk.h))(c)
    stage.count_activations = True
    x = np.zeros((M * B, S), dtype=np.int64)
    forward_backward(stage, x, x, slice(0, M * B))
    w = Workload(2 * P, C, H, S, global_batch=M * B, vocab=V)
    mem = memory_per_rank(CPU, w, Plan(pp=P, micro_batch=B))
    peak0 = world.bcast(stage.peak_activation_bytes, root=0)
    assert peak0 == mem["activations"], (peak0, mem["activations"])
    topo.free()
