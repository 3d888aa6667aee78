"""Rounding to the 16-bit formats (mpi_tp.core.precision) against ml_dtypes' bfloat16 and PyTorch's
bfloat16 and float16: to nearest, ties to even, overflow to inf, inf and NaN kept, subnormals; on edge
values written out by their bits and on a million random bit patterns (every exponent, NaNs included)."""
import numpy as np
import pytest
from test_standin import cupy  # noqa: F401 (the fixture: the stand-in as the backend for one test)

from mpi_tp.core.errors import UserError
from mpi_tp.core.precision import (
    PRECISIONS,
    precision,
    round_bf16,
    round_to,
    stored_bytes,
    to_storage,
)

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is a requirement: pip install -e .")


def bits(*words):
    return np.array(words, dtype=np.uint32).view(np.float32)


# bf16 keeps the upper 16 bits: 0x3F80_0000 is 1.0; 0x3F80_8000 lies halfway to the next bf16 value.
EDGES = np.concatenate([
    bits(0x00000000, 0x80000000,                          # +0, -0
         0x3F800000, 0x3F808000, 0x3F818000,              # 1; a tie that goes down (even); a tie that goes up
         0x3F807FFF, 0x3F808001,                          # just below and just above the tie
         0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,  # bf16's largest; still it; rounds to inf; fp32's max
         0x7F800000, 0xFF800000,                          # inf, -inf
         0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F80FFFF,  # quiet NaNs; signalling NaNs whose bits would clear
         0x00000001, 0x00008000, 0x00010000, 0x00018000,  # fp32's smallest subnormal; ties among subnormals
         0x007FFFFF, 0x00800000, 0x807FFFFF),             # the largest subnormal (rounds up to the smallest normal)
    np.array([65504.0, 65519.996, 65520.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 6.1e-5, -1e5, 0.1, 1 / 3],
             dtype=np.float32),
])


def same(a, b):
    """Equal bit for bit, except that any NaN equals any NaN (the payload is not part of the contract)."""
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    both = np.isnan(a) & np.isnan(b)
    return bool(np.all(both | (a.view(np.uint32) == b.view(np.uint32)))) and np.array_equal(np.isnan(a), np.isnan(b))


def reference_bf16(x):
    with np.errstate(invalid="ignore", over="ignore"):          # NaNs and overflow are among the inputs
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def test_bf16_edges_equal_ml_dtypes():
    got = round_bf16(EDGES)
    assert got.dtype == np.float32 and same(got, reference_bf16(EDGES))
    one, tie_down, tie_up = got[2:5].view(np.uint32)
    assert (one, tie_down, tie_up) == (0x3F800000, 0x3F800000, 0x3F820000)       # ties to even, both ways
    assert np.isinf(got[9]) and got[8] == got[7]                                 # past bf16's largest: inf
    assert np.isnan(got[15]) and np.isnan(got[16])                               # a NaN never becomes inf


def test_bf16_on_a_million_random_bit_patterns():
    words = np.random.default_rng(0).integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    x = words.view(np.float32)
    assert np.isnan(x).sum() > 1000                     # the NaNs are among them (1/256 of all patterns)
    assert same(round_bf16(x), reference_bf16(x))


def test_storage_is_two_bytes_and_exact():
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    s = to_storage(x, precision("bf16"))
    assert s.dtype == ml_dtypes.bfloat16 and s.itemsize == 2 and stored_bytes(precision("bf16")) == 2
    assert same(s.astype(np.float32), round_bf16(x))
    h = to_storage(x, precision("fp16"))
    assert h.dtype == np.float16 and same(h.astype(np.float32), round_to(x, precision("fp16")))
    assert to_storage(x, precision("fp32")).dtype == np.float32 and stored_bytes(precision("fp64")) == 8


def test_fp16_rounds_as_pytorch_does():
    """Overflow past 65504 (65520 is the tie to inf), subnormals down to 2^-24, ties to even."""
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle (the hf-oracle extra)")
    got = round_to(EDGES, precision("fp16"))
    want = torch.from_numpy(EDGES.copy()).to(torch.float16).to(torch.float32).numpy()
    assert same(got, want)
    assert got[EDGES == 65504.0][0] == 65504.0 and np.isinf(got[EDGES == 65520.0][0])
    assert got[EDGES == np.float32(2.0 ** -25)][0] == 0.0                        # the tie below 2^-24: to even, 0


def test_bf16_rounds_as_pytorch_does():
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle (the hf-oracle extra)")
    want = torch.from_numpy(EDGES.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    assert same(round_bf16(EDGES), want)


def test_the_formats_and_a_bad_name():
    assert [(p.name, p.bytes_per_value, p.loss_scaling) for p in PRECISIONS.values()] == \
        [("fp32", 4, False), ("bf16", 2, False), ("fp16", 2, True), ("fp64", 8, False)]
    assert all(p.master == p.compute for p in PRECISIONS.values())              # fp32 masters (fp64: itself)
    with pytest.raises(UserError, match="choose one of fp32, bf16, fp16, fp64"):
        precision("fp8")


def test_bf16_emulation_on_the_cupy_stand_in(cupy):
    """CuPy has no bfloat16 dtype: there bf16 is float32 storage rounded by the same bit arithmetic; on the
    stand-in (the CuPy code path without a GPU) it gives ml_dtypes' values, and fp32's 4 bytes per value."""
    x = cupy.asarray(EDGES)
    got = round_bf16(x)
    assert type(got) is type(x) and same(cupy.asnumpy(got), reference_bf16(EDGES))
    assert to_storage(x, precision("bf16")).dtype == np.float32 and stored_bytes(precision("bf16"), cupy) == 4
    assert same(cupy.asnumpy(round_to(x, precision("fp16"))), round_to(EDGES, precision("fp16")))
