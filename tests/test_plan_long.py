"""The planner's activation memory at context parallelism against what the model keeps (issue 43): the same
layout scaled down, measured on the blocks' caches after a forward. At cp = the world size (ring attention: its
output and log-sum-exp, no scores) and at one rank (the blocked form: its probabilities), GPT-2 and Llama
(grouped-query, SwiGLU), float32, with dropout: mpi_tp.planning.memory.activation_bytes_per_layer times the
layers equals the bytes the largest rank's blocks hold, exactly."""
import numpy as np
import pytest

from mpi_tp.core.testing import all_true
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.planning.costmodel import Plan
from mpi_tp.planning.machines import Machine
from mpi_tp.planning.memory import activation_bytes_per_layer
from mpi_tp.planning.workload import Workload

CPU = Machine(name="here", ranks_per_node=4, gemm_flops=1e10, elem_rate=1e9, mem_bw=1e10, mem_bytes=1e10,
              intra_alpha=1e-5, intra_bw=1e9, inter_alpha=1e-5, inter_bw=1e9, bytes_per_value=4)
ARCHS = {"gpt2": (dict(), dict()),
         "llama": (dict(arch="llama", n_kv_head=2, intermediate_size=40),
                   dict(arch="llama", n_kv_head=2, intermediate_size=40))}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_planner_counts_what_a_cp_rank_keeps(world, arch):
    model_kw, shape_kw = ARCHS[arch]
    Z = world.Get_size()
    S, L, B = 16 * Z, 2, 2
    topo = Topology.create(world, tp=1, cp=Z)
    cfg = GPTConfig(vocab_size=64, block_size=S, n_layer=L, n_head=4, n_embd=32, dropout=0.1, **model_kw)
    model = GPT(cfg, topo, dtype="float32", seed=0)
    x = np.random.default_rng(0).integers(0, 64, (B, S + 1))
    model.forward(x[:, :-1], x[:, 1:])
    kept = world.allreduce(sum(b.activation_bytes() for b in model.h), op=max_op())
    w = Workload(L, 32, 4, S, B, vocab=64, dropout=True, **shape_kw)
    want = L * activation_bytes_per_layer(CPU, w, Plan(cp=Z, micro_batch=B))
    assert all_true(kept == want, world), (kept, want)
    topo.free()


def max_op():
    from mpi4py import MPI
    return MPI.MAX


@pytest.mark.mpi(min_size=2)
def test_bench_reports_the_count_at_cp(world):
    """`mpi-tp bench --cp Z --json`'s activation_bytes_per_layer (block 0's caches, the largest rank) equals its
    activation_bytes_per_layer_formula at cp = the world size: ring attention's output and log-sum-exp counted
    (the formula used to count cp as selective recomputation's terms, 1 S B C + H S B short)."""
    from mpi_tp.commands.bench import step as bench
    r = bench.run_shape(world, 48, 4, 1, 8 * world.Get_size(), 2, steps=1, warmup=0, cp=world.Get_size())
    assert all_true(r["activation_bytes_per_layer"] == r["activation_bytes_per_layer_formula"], world), \
        (r["activation_bytes_per_layer"], r["activation_bytes_per_layer_formula"])


@pytest.mark.mpi(min_size=1)
def test_the_planner_s_stage_is_what_a_step_holds(world):
    """The planner's activations and logits for a one-stage layout (memory_per_rank: the layers' count times the
    layers, the logits, and the final norm's and the output layer's inputs) against the peak of live activation
    arrays over a bench step (mpi_tp.core.memory.MemoryMeter, the largest rank) at cp = the world size: within 1%
    (the per-row statistics of the final norm are what is left out). experiments/planner/long_seq_memory.py does
    the same at S = 2048 ... 8192."""
    from mpi_tp.commands.bench import step as bench
    from mpi_tp.planning.memory import memory_per_rank
    Z = world.Get_size()
    for S, B in ((16 * Z, 2), (64 * Z, 1)):
        r = bench.run_shape(world, 48, 4, 2, S, B, steps=1, warmup=0, cp=Z)
        mem = memory_per_rank(CPU, Workload(2, 48, 4, S, B, vocab=GPTConfig().vocab_size), Plan(cp=Z, micro_batch=B))
        measured = r["memory_measured"]["max"]["activations"]
        assert all_true(abs(mem["activations"] + mem["logits"] - measured) <= 0.01 * measured, world), \
            (S, B, mem["activations"] + mem["logits"], measured)
