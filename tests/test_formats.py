"""16-bit buffers through the collectives (mpi_tp.parallel.formats): bfloat16 as its words with a sum of
our own, float16 as MPI's own type; at 1, 2, 3 and 4 ranks.

The bound. Each addition of two values rounds once, with a relative error of at most u (bfloat16:
u = 2^-8, float16: u = 2^-11: half an ulp at 1), and a sum over P ranks adds P - 1 times, in an order
MPI chooses. Whatever the order, the computed sum s of x_1 ... x_P satisfies
|s - sum x_i| <= gamma_{P-1} sum |x_i|, gamma_k = k u / (1 - k u) (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., eq. 4.4), and that is what these tests allow, elementwise. Sums of small
integers are exact in either format (every partial sum is representable), so those must be equal.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpi_tp.core.precision import round_bf16
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.comm_stats import CommStats
from mpi_tp.parallel.formats import _bf16_sum, reduction
from mpi_tp.parallel.formats import words_to_float32 as widen

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is a requirement: pip install -e .")
BF16 = np.dtype(ml_dtypes.bfloat16)
U = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
pytestmark = pytest.mark.mpi(min_size=1)


def group(world):
    return Group(world, "tp", CommStats())


def contributions(world, n, dtype, seed=0):
    """Every rank's x (float64, already representable in dtype): rank r's is the r-th of P draws."""
    P = world.Get_size()
    draws = np.random.default_rng(seed).standard_normal((P, n)) * 10.0 ** np.random.default_rng(seed + 1).integers(
        -3, 4, (P, n))
    return draws.astype(np.float32).astype(dtype).astype(np.float64)


def gamma(k, u):
    return k * u / (1 - k * u)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=["bf16", "fp16"])
def test_all_reduce_of_small_integers_is_exact(world, dtype):
    P, g = world.Get_size(), group(world)
    x = np.arange(12, dtype=np.float64).reshape(3, 4) % 7 + world.Get_rank()        # sums below 256: exact
    got = g.all_reduce(x.astype(dtype))
    want = sum(np.arange(12).reshape(3, 4) % 7 + r for r in range(P))
    assert got.dtype == dtype and np.array_equal(got.astype(np.float64), want)
    if P > 1:
        assert g.stats.snapshot()["tp/all_reduce"]["bytes"] == 12 * 2                # 2 bytes a value on the wire


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=["bf16", "fp16"])
def test_all_reduce_within_the_rounding_bound_and_alike_on_every_rank(world, dtype):
    P, g = world.Get_size(), group(world)
    xs = contributions(world, 4096, dtype if dtype == BF16 else np.float16)
    if dtype == np.float16:
        xs = np.clip(xs, -1000, 1000).astype(np.float16).astype(np.float64)         # no overflow past 65504
    got = g.all_reduce(xs[world.Get_rank()].astype(dtype)).astype(np.float64)
    exact, scale = xs.sum(axis=0), np.abs(xs).sum(axis=0)
    assert np.all(np.abs(got - exact) <= gamma(P - 1, U[dtype.name]) * scale)
    assert np.array_equal(got.astype(dtype).astype(np.float64), got)                # values of the format
    everyone = world.allgather(got)
    assert all(np.array_equal(everyone[0], other) for other in everyone), "ranks hold different sums"


def test_the_bf16_sum_rounds_each_addition_once():
    """The reduction itself, on two buffers: bf16(float32(a) + float32(b)), ties to even."""
    a = np.array([1.0, 1.0, 3.0, 1e30], dtype=np.float32).astype(BF16)
    b = np.array([2.0 ** -8, 3 * 2.0 ** -8, 2.0 ** -7, -1e30], dtype=np.float32).astype(BF16)
    want = round_bf16(a.astype(np.float32) + b.astype(np.float32))
    words = b.view(np.uint16).copy()
    _bf16_sum(a.view(np.uint16).tobytes(), memoryview(words), None)
    assert np.array_equal(widen(words), want)
    assert widen(words)[0] == 1.0 and widen(words)[1] == 1.015625                    # tie to even, both ways


def test_gather_scatter_and_messages_carry_bf16_words(world):
    P, r, g = world.Get_size(), world.Get_rank(), group(world)
    mine = (np.arange(6, dtype=np.float32) + 10 * r).reshape(2, 3).astype(BF16)
    whole = g.all_gather(mine, [2] * P, axis=0)
    assert whole.dtype == BF16 and np.array_equal(whole.astype(np.float32),
                                                  np.concatenate([np.arange(6).reshape(2, 3) + 10 * k
                                                                  for k in range(P)]).astype(np.float32))
    summed = g.reduce_scatter(np.ones((2 * P, 3), dtype=BF16) * (r + 1), [2] * P, axis=0)
    assert summed.dtype == BF16 and np.all(summed.astype(np.float32) == P * (P + 1) / 2)
    if P > 1:
        peer = (r + 1) % P
        got = np.zeros(4, dtype=BF16)
        recv = g.irecv(got, (r - 1) % P, tag=7)
        send = g.isend(np.full(4, r + 0.5, dtype=np.float32).astype(BF16), peer, tag=7)
        recv.wait(), send.wait()
        assert np.all(got.astype(np.float32) == (r - 1) % P + 0.5)


def test_bf16_reduces_by_sum_only():
    with pytest.raises(ValueError, match="sum only"):
        reduction(MPI.MAX, np.ones(3, dtype=BF16))
    assert reduction(MPI.MAX, np.ones(3, dtype=np.float16)) == MPI.MAX          # float16: MPI's own
