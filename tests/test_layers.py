"""Each tensor-parallel layer equals its serial self on identical weights (float64, uneven splits).

Shares per rank at tp = 2 / 3 / 4 (tests/run.sh runs 1, 2, 3 and 4 ranks): features 23 as
12+11 / 8+8+7 / 6+6+6+5 and 7 as 4+3 / 3+2+2 / 2+2+2+1; vocabulary 37 as 19+18 / 13+12+12 /
10+9+9+9; 5 heads as 3+2 / 2+2+1 / 2+1+1+1; the MLP's 4C = 28 as 14+14 / 10+9+9 / 7+7+7+7
(4C divides by 2 and 4 for every C, so the MLP splits unevenly only at 3 ranks).

The serial layer is the same class on a one-rank group (COMM_SELF); both are
built from the same seed and names, so their weights agree slice for slice.
We compare each rank's shard with the matching slice first, then the gathered
whole (local, then global).
"""
import numpy as np
import pytest

from mpi_tp.core import kernels as kern
from mpi_tp.core.testing import assert_close, gather_full, randomize
from mpi_tp.model.attention import ParallelAttention
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.dropout import Dropout
from mpi_tp.model.forward_pass import Pass
from mpi_tp.model.mlp import ParallelMLP
from mpi_tp.model.parallel_cross_entropy import VocabParallelCrossEntropy
from mpi_tp.model.parallel_embedding import VocabParallelEmbedding
from mpi_tp.model.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mpi_tp.parallel.topology import Topology

pytestmark = pytest.mark.mpi(min_size=1)
RTOL = 1e-10
F64 = np.float64


@pytest.fixture
def topos(world):
    return Topology.serial(), Topology.create(world)


def check_params(ser, par, world, scale=None):
    """Every parameter: local shard vs the serial slice, then the gathered full tensor."""
    serial = {p.name: p for p in ser.parameters()}
    for p in par.parameters():
        q = serial[p.name]
        for which in ("data", "grad"):
            ref = getattr(q, which)
            assert_close(getattr(p, which), ref[p.index()], RTOL, f"{p.name}.{which} (local shard)", scale)
            assert_close(gather_full(p, world, which), ref, RTOL, f"{p.name}.{which} (gathered)", scale)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("gather_output", [True, False])
@pytest.mark.parametrize("out_features", [23, 7])
def test_column_parallel_linear(topos, world, gather_output, out_features):
    serial, tp = topos
    if out_features < tp.tp.size:
        pytest.skip("fewer output features than ranks")
    args = ("lin", 20, out_features)
    ser = ColumnParallelLinear(*args, serial.tp, F64, seed=3)
    par = ColumnParallelLinear(*args, tp.tp, F64, seed=3, gather_output=gather_output)
    randomize(ser), randomize(par)
    x, dout = rand(3, 5, 20), rand(3, 5, out_features, seed=1)
    y_ref = ser.forward(x)
    y = par.forward(x)
    lo, hi = par.weight.start, par.weight.stop
    assert_close(y, y_ref if gather_output else y_ref[..., lo:hi], RTOL, "output")
    dx_ref = ser.backward(dout)
    dx = par.backward(dout if gather_output else np.ascontiguousarray(dout[..., lo:hi]))
    assert_close(dx, dx_ref, RTOL, "dinp")
    check_params(ser, par, world)


@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear(topos, world, input_is_parallel):
    serial, tp = topos
    ser = RowParallelLinear("lin", 23, 20, serial.tp, F64, seed=4)
    par = RowParallelLinear("lin", 23, 20, tp.tp, F64, seed=4, input_is_parallel=input_is_parallel)
    randomize(ser), randomize(par)
    x, dout = rand(3, 5, 23), rand(3, 5, 20, seed=1)
    lo, hi = par.weight.start, par.weight.stop
    y_ref = ser.forward(x)
    y = par.forward(np.ascontiguousarray(x[..., lo:hi]) if input_is_parallel else x)
    assert_close(y, y_ref, RTOL, "output")
    dx_ref = ser.backward(dout)
    dx = par.backward(dout)
    assert_close(dx, dx_ref if not input_is_parallel else dx_ref[..., lo:hi], RTOL, "dinp")
    check_params(ser, par, world)


def test_vocab_parallel_embedding_and_tied_head(topos, world):
    serial, tp = topos
    ser = VocabParallelEmbedding("wte", 37, 20, serial.tp, F64, seed=5)
    par = VocabParallelEmbedding("wte", 37, 20, tp.tp, F64, seed=5)
    randomize(ser), randomize(par)
    ids = np.random.default_rng(2).integers(0, 37, (4, 6))
    ids[0, :3] = 36                                            # repeats and the last row
    assert_close(par.forward(ids), ser.forward(ids), RTOL, "lookup")
    dout = rand(4, 6, 20, seed=3)
    ser.backward(dout)
    par.backward(dout)
    x, dlog = rand(4, 6, 20, seed=4), rand(4, 6, 37, seed=5)
    assert_close(par.logits_forward(x), ser.logits_forward(x)[..., par.start:par.stop], RTOL, "logits")
    dx_ref = ser.logits_backward(dlog)
    assert_close(par.logits_backward(np.ascontiguousarray(dlog[..., par.start:par.stop])), dx_ref,
                 RTOL, "head dinp")
    check_params(ser, par, world)


def test_vocab_parallel_cross_entropy(topos):
    serial, tp = topos
    V = 37
    logits = rand(4, 6, V) * 3
    targets = np.random.default_rng(1).integers(0, V, (4, 6))
    loss_ref, cache = kern.cross_entropy_forward(logits, targets)   # the serial kernel: an independent reference
    dlogits_ref = kern.cross_entropy_backward(0.7, cache)
    emb = VocabParallelEmbedding("wte", V, 4, tp.tp, F64)
    ce = VocabParallelCrossEntropy(tp.tp, emb.start, emb.stop)
    loss = ce.forward(np.ascontiguousarray(logits[..., emb.start:emb.stop]), targets)
    assert_close(np.array(loss), np.array(loss_ref), RTOL, "loss")
    assert_close(ce.backward(0.7), dlogits_ref[..., emb.start:emb.stop], RTOL, "dlogits")
    with pytest.raises(RuntimeError, match="without a matching forward"):
        ce.backward()


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_parallel_attention(topos, world, dropout):
    serial, tp = topos
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=5, n_embd=20)
    if cfg.n_head < tp.tp.size:
        pytest.skip("more ranks than heads")
    ser = ParallelAttention("attn", cfg, serial, F64, 6, layer=1)
    par = ParallelAttention("attn", cfg, tp, F64, 6, layer=1)
    ps = Pass(7, masks=Dropout(dropout, 9).masks())          # the pass's dropout masks (None without dropout)
    randomize(ser), randomize(par)
    assert par.H_i in ((5 + tp.tp.size - 1) // tp.tp.size, 5 // tp.tp.size)
    x, dout = rand(2, 7, 20), rand(2, 7, 20, seed=1)
    assert_close(par.forward(x, ps), ser.forward(x, ps), RTOL, "output")
    dx_ref = ser.backward(dout)
    assert_close(par.backward(dout), dx_ref, RTOL, "dinp")
    scale = max(float(np.abs(p.grad).max()) for p in ser.parameters())
    check_params(ser, par, world, scale)    # key-bias gradients are ~0: compare at the layer's scale


def test_parallel_mlp(topos, world):
    serial, tp = topos
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=7, n_embd=7)   # 4C = 28: 10+9+9 at 3
    ser = ParallelMLP("mlp", cfg, serial, F64, 7)
    par = ParallelMLP("mlp", cfg, tp, F64, 7)
    randomize(ser), randomize(par)
    x, dout = rand(2, 5, 7), rand(2, 5, 7, seed=1)
    assert_close(par.forward(x), ser.forward(x), RTOL, "output")
    assert_close(par.backward(dout), ser.backward(dout), RTOL, "dinp")
    check_params(ser, par, world)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_vocab_parallel_cross_entropy_of_16_bit_logits_is_fp32(topos, fmt):
    """bf16/fp16 logits: everything in fp32 (the all-reduces too), dlogits rounded once. Against the serial
    fp32 kernel on the widened logits: the loss within fp32 rounding of a sum in another order (1e-6), each
    dlogit within one ulp of the 16-bit format (its fp32 value may sit on the other side of a tie)."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is a requirement: pip install -e .")
    dtype, ulp, sub = {"bf16": (np.dtype(ml_dtypes.bfloat16), 2.0 ** -7, 2.0 ** -133),    # sub: the spacing of
                       "fp16": (np.dtype(np.float16), 2.0 ** -10, 2.0 ** -24)}[fmt]          # the subnormals
    serial, tp = topos
    V = 37
    logits = (rand(4, 6, V) * 3).astype(np.float32).astype(dtype)
    targets = np.random.default_rng(1).integers(0, V, (4, 6))
    loss_ref, cache = kern.cross_entropy_forward(logits.astype(np.float32), targets)
    dlogits_ref = kern.cross_entropy_backward(0.7, cache)
    emb = VocabParallelEmbedding("wte", V, 4, tp.tp, F64)
    ce = VocabParallelCrossEntropy(tp.tp, emb.start, emb.stop)
    loss = ce.forward(np.ascontiguousarray(logits[..., emb.start:emb.stop]), targets)
    assert isinstance(loss, float) and abs(loss - loss_ref) <= 1e-6 * abs(loss_ref)
    dlogits = ce.backward(0.7)
    want = dlogits_ref[..., emb.start:emb.stop]
    assert dlogits.dtype == dtype
    assert np.all(np.abs(dlogits.astype(np.float32) - want) <= ulp * np.abs(want) + sub)
