"""The planner's memory per rank (mpi_tp.planning.memory) at every ZeRO stage and recomputation mode, against
Rajbhandari et al. 2020's closed forms at the run's precision: Psi the rank's parameters, D the replicas,
w g k the bytes per parameter of weights, gradients and optimizer state (fp32 4, 4, 8; bf16 2, 2, 12), U one
unit's parameters (the largest block or the embedding with the positions):

    zero 0  (w + g + k) Psi        zero 1  (w + g) Psi + (g + k) Psi / D
    zero 2  w Psi + (g + k) Psi / D + g U        zero 3  (w + g + k) Psi / D + (w + g) U

(the measured side: tests/test_memory_accounting.py, experiments/memory/memory_peak.py)."""
import pytest

from mpi_tp.planning.costmodel import Plan, Workload
from mpi_tp.planning.machines import Machine, with_precision
from mpi_tp.planning.memory import memory_per_rank, params_per_rank, unit_params

CPU = Machine(name="test", ranks_per_node=4, gemm_flops=1e11, elem_rate=1e9, mem_bw=1e10, mem_bytes=1e10,
              intra_alpha=1e-5, intra_bw=1e10, inter_alpha=1e-4, inter_bw=1e9)
W = Workload(n_layer=4, n_embd=64, n_head=4, seq=32, global_batch=16, vocab=256)


@pytest.mark.parametrize("precision, w, g, k", [("fp32", 4, 4, 8), ("bf16", 2, 2, 12)])
def test_zero_stages_follow_the_closed_forms(precision, w, g, k):
    m, D = with_precision(CPU, precision), 4
    lay = {z: Plan(tp=2, dp=D, micro_batch=2, zero=z) for z in range(4)}
    psi, U = params_per_rank(W, lay[0]), unit_params(W, lay[0])
    assert U == max((12 * 64 * 64 + 7 * 64) / 2 + 6 * 64, 128 * 64 + 32 * 64)      # here the embedding
    expect = {0: (w + g + k) * psi, 1: (w + g) * psi + (g + k) * psi / D,
              2: w * psi + (g + k) * psi / D + g * U, 3: (w + g + k) * psi / D + (w + g) * U}
    for z, total in expect.items():
        mem = memory_per_rank(m, W, lay[z])
        assert mem["parameters"] + mem["gradients"] + mem["optimizer"] == pytest.approx(total), z
        assert mem["weights_grads"] == mem["parameters"] + mem["gradients"]
    one = memory_per_rank(m, W, Plan(tp=2, micro_batch=2, zero=3))                 # D = 1: nothing to share
    assert one["parameters"] + one["gradients"] + one["optimizer"] == pytest.approx(expect[0])


def test_recomputation_modes_keep_less_each():
    mems = {r: memory_per_rank(CPU, W, Plan(micro_batch=2, recompute=r)) for r in ("none", "selective", "full")}
    assert mems["none"]["activations"] > mems["selective"]["activations"] > mems["full"]["activations"]
    assert memory_per_rank(CPU, W, Plan(micro_batch=2, recompute=True)) == mems["full"]      # True: full
    assert memory_per_rank(CPU, W, Plan(micro_batch=2, recompute=False)) == mems["none"]
    # selective drops the attention core, H S^2 B 4-byte values a layer (S below the online softmax's)
    assert mems["none"]["activations"] - mems["selective"]["activations"] == 4 * 4 * 32 * 32 * 2 * 4
    with pytest.raises(ValueError, match="recompute 'half'"):
        memory_per_rank(CPU, W, Plan(micro_batch=2, recompute="half"))
