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


def _parts(m, w, lay, recompute="none"):
    """(one block's activations, its W inputs, the output layer's W inputs, one micro-batch's logits) by hand."""
    from mpi_tp.planning.memory import activation_bytes_per_layer
    S, B, C, T, v = w.seq, lay.micro_batch, w.n_embd, lay.tp, m.bytes_per_value
    t_sp = T if lay.sp else 1
    A = S * B * C * v / t_sp if recompute == "full" else activation_bytes_per_layer(m, w, lay, recompute)
    W = S * B * C * (6 / t_sp + 2 + 12 / T) * v           # norms 4 + column inputs 2 (/T sp), row dY 2, 12 / T
    head = S * B * (C / t_sp + w.vocab / T) * v
    return A, W, head, B * S * w.vocab / T * (v + max(v, 4)) + 2 * S * B * C / t_sp * v   # + ln_f's, the head's inputs


def test_full_recomputation_keeps_the_rebuilt_layer_or_the_logits_not_both():
    from mpi_tp.planning.memory import activation_bytes_per_layer
    for vocab in (256, 65536):                               # the rebuilt layer larger; the logits larger
        w = Workload(n_layer=4, n_embd=64, n_head=4, seq=32, global_batch=2, vocab=vocab)
        lay = Plan(micro_batch=2, recompute="full")
        A, _, _, logits = _parts(CPU, w, lay, "full")
        rebuilt = activation_bytes_per_layer(CPU, w, lay)
        mem = memory_per_rank(CPU, w, lay)
        assert mem["activations"] + mem["logits"] == pytest.approx(4 * A + max(rebuilt, logits)), vocab
    assert (rebuilt < logits) and mem["logits"] == logits   # at 65536 the logits are the peak's


def test_a_pipeline_is_its_first_or_its_last_stage():
    """1F1B: stage 0 holds min(P, M) micro-batches and no logits, the last stage one and the logits."""
    for vocab, first in ((256, True), (1 << 20, False)):
        w = Workload(n_layer=8, n_embd=64, n_head=4, seq=32, global_batch=16, vocab=vocab)
        lay = Plan(pp=4, micro_batch=2)
        A, _, _, logits = _parts(CPU, w, lay)
        mem = memory_per_rank(CPU, w, lay)
        want = (4 * 2 * A, 0.0) if first else (2 * A, logits)          # 2 blocks a stage, M = 8 >= P
        assert (mem["activations"], mem["logits"]) == pytest.approx(want), vocab


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
def test_zero_bubble_schedules_keep_the_deferred_ws_inputs(tp, sp):
    """zb-h1 (a stage's n blocks: A = n a, W = n w): stage 0 (P - 1) A and the micro-batch in B at its largest,
    max(A + r, W - w + a + r, W) with r full recomputation's rebuilt block; the last stage (P - 1) W' and
    max(A + logits, A + h + r, W' - w + a + r, W'), W' = W + h with the output layer's h; zb-v: min(2P + 2, 2M) chunk micro-batches of L / (2P) blocks at max(A, W), the output layer's
    W inputs of min(M, P) micro-batches and the logits; both with and without full recomputation."""
    P, M, L = 4, 8, 16
    for vocab in (256, 1 << 20):
        w = Workload(n_layer=L, n_embd=64, n_head=4, seq=32, global_batch=2 * M, vocab=vocab)
        for recompute in ("none", "full"):
            h1 = Plan(tp=tp, sp=sp, pp=P, micro_batch=2, recompute=recompute, schedule="zb-h1")
            A, W, head, logits = _parts(CPU, w, h1, recompute)
            n, extra = L // P, 0.0
            if recompute == "full":
                from mpi_tp.planning.memory import activation_bytes_per_layer
                extra = activation_bytes_per_layer(CPU, w, h1)
            first = (P - 1) * n * A + max(n * A + extra, n * W - W + A + extra, n * W)
            late = n * W + head                       # the last stage's W's, with the output layer's
            last = (P - 1) * late + max(n * A + logits, n * A + head + extra, late - W + A + extra, late)
            mem = memory_per_rank(CPU, w, h1)
            assert mem["activations"] + mem["logits"] == pytest.approx(max(first, last)), (vocab, recompute)
            zbv = Plan(tp=tp, sp=sp, pp=P, micro_batch=2, recompute=recompute, schedule="zb-v", virtual=2)
            want = min(2 * P + 2, 2 * M) * (L // (2 * P)) * max(A, W) + min(M, P) * head + max(extra, logits)
            mem = memory_per_rank(CPU, w, zbv)
            assert mem["activations"] + mem["logits"] == pytest.approx(want), (vocab, recompute)
    one_f = memory_per_rank(CPU, w, Plan(tp=tp, sp=sp, pp=P, micro_batch=2))
    assert memory_per_rank(CPU, w, h1)["total"] > one_f["total"]        # the last stage's W's outgrow stage 0
