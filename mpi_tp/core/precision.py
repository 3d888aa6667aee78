"""Number formats: what a value is stored in, what a product accumulates in, and rounding to 16 bits.

    p = precision("bf16")          # Precision(name='bf16', bits=16, ...): --precision's values
    x16 = to_storage(x, p)         # bf16 storage (NumPy: ml_dtypes.bfloat16; CuPy: see below)
    y = round_to(x, p)             # x rounded to bf16's values, kept in float32 (what a 16-bit GEMM's output is)

Mixed precision as Megatron, BLOOM and Llama 3 train (Micikevicius et al. 2018): parameters,
activations, gradients and the collectives that carry them in a 16-bit format; the optimizer's
master weights and moments in fp32; products of 16-bit inputs accumulated in fp32 and rounded
once. The formats (IEEE 754 binary16 and Google's bfloat16; fp32's 8-bit exponent, 1 sign bit):

    name  bits  exponent  fraction  largest finite   smallest normal  eps (1 ulp at 1)  loss scaling
    fp32   32      8        23      3.40e38          1.18e-38         1.19e-7           no
    bf16   16      8         7      3.39e38          1.18e-38         7.81e-3           no
    fp16   16      5        10      65504            6.10e-5          9.77e-4           yes
    fp64   64     11        52      1.80e308         2.23e-308        2.22e-16          no (exactness)

bf16 is fp32 with the low 16 bits of the fraction rounded away: the same range, 8 bits of
precision; fp16 has 11 bits but overflows past 65504 and loses small gradients below 6e-8 (its
smallest subnormal), which loss scaling moves into its range. Rounding is to nearest, ties to
even, in every format; inf and NaN stay what they are (a NaN stays a NaN: its payload is kept
quiet); a finite value past the largest rounds to inf.

Where the arrays live. NumPy has float16 but no bfloat16: bf16 storage is ml_dtypes.bfloat16 (a
well-kept package: JAX's). CuPy has float16 but no bfloat16 dtype (cupy/cupy#7527): there bf16 is
emulated, float32 storage whose values are rounded to bf16 (`round_bf16`, integer arithmetic on the
bits, the same on both array modules), so the numbers are bf16's and the bytes are fp32's; memory
accounting then says 4 bytes per value, not 2. (These helpers do that; training refuses --precision
bf16 on CuPy, mpi_tp.training.config: the emulation would save no byte.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from mpi_tp.core import backend
from mpi_tp.core.errors import UserError


@dataclass(frozen=True)
class Precision:
    """One --precision: its name, its storage and its bytes per value, the accumulation and master dtype."""

    name: str
    bits: int
    dtype: str               # what its arrays are stored in on NumPy (dtype_of turns "bfloat16" into ml_dtypes')
    compute: str             # what products accumulate in, and what the statistics are computed in
    master: str              # the optimizer's copy of the weights and its moments
    loss_scaling: bool       # fp16's dynamic loss scaling (bf16 and the wide formats need none)

    @property
    def bytes_per_value(self) -> int:
        return self.bits // 8

    @property
    def half(self) -> bool:
        """A 16-bit format (bf16 or fp16)."""
        return self.bits == 16


PRECISIONS = {
    "fp32": Precision("fp32", 32, "float32", "float32", "float32", False),
    "bf16": Precision("bf16", 16, "bfloat16", "float32", "float32", False),
    "fp16": Precision("fp16", 16, "float16", "float32", "float32", True),
    "fp64": Precision("fp64", 64, "float64", "float64", "float64", False),
}


def precision_of(dtype) -> Precision:
    """The Precision whose arrays are stored in `dtype` (a name or a dtype: 'bfloat16' -> bf16)."""
    name = getattr(dtype, "name", str(dtype))
    return next(p for p in PRECISIONS.values() if p.dtype == name)


def precision(name: str) -> Precision:
    """The Precision of --precision `name`; one line saying the choices otherwise."""
    if name not in PRECISIONS:
        raise UserError(f"--precision {name!r}: choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def bfloat16():
    """NumPy's bfloat16 dtype (ml_dtypes), or one line saying how to get it."""
    try:
        import ml_dtypes
    except ImportError:
        raise UserError("bf16 on NumPy needs ml_dtypes: pip install ml_dtypes (mpi_tp's requirements have it)") \
            from None
    return numpy.dtype(ml_dtypes.bfloat16)


def dtype_of(dtype):
    """numpy.dtype(dtype), with 'bfloat16' (as checkpoints and --precision bf16 name it) NumPy's through
    ml_dtypes."""
    return bfloat16() if str(dtype) == "bfloat16" else numpy.dtype(dtype)


def is_bf16(x) -> bool:
    """An array (or dtype) of NumPy's bfloat16 (ml_dtypes); CuPy has none (there bf16 is emulated in fp32)."""
    return getattr(getattr(x, "dtype", x), "name", None) == "bfloat16"


def is_half(x) -> bool:
    """An array (or dtype) of a 16-bit floating-point format: float16, or bfloat16."""
    dtype = getattr(x, "dtype", x)
    return getattr(dtype, "itemsize", 0) == 2 and (dtype.kind == "f" or is_bf16(dtype))


def widen(a):
    """fp32 values of a 16-bit array (exact: every 16-bit value is an fp32 value)."""
    return a.astype(backend.array_module(a).float32)


def narrow(a, dtype):
    """fp32 a rounded once to `dtype` (to nearest, ties to even; past the format's largest: inf)."""
    with numpy.errstate(over="ignore"):
        return a.astype(dtype)


def computed(a):
    """a in the format its arithmetic runs in: a 16-bit array widened to fp32, an fp32 or fp64 one itself."""
    return widen(a) if is_half(a) else a


def stored(a, dtype):
    """A result computed in fp32 (or wider) in the inputs' `dtype`: rounded once to 16 bits, else itself."""
    return a if a.dtype == dtype else narrow(a, dtype)


def sum_rows(a, axis=0):
    """a summed over `axis` as a GPU sums a 16-bit tensor (a bias's gradient): in fp32, rounded once to
    a's format (NumPy would add bf16 in bf16: 1000 ones give 256). fp32 and fp64 arrays: a.sum itself."""
    return stored(computed(a).sum(axis=axis), a.dtype)


def round_bf16(x):
    """float32 x rounded to bfloat16's values, as float32 (to nearest, ties to even; inf and NaN kept).

    bf16 is fp32's upper 16 bits, so rounding is integer arithmetic on the bits: add 0x7FFF plus the
    lowest kept bit (the tie goes to the even neighbour), then clear the 16 low bits. A carry out of the
    fraction rounds up the exponent, past the largest finite value to inf, as it should. A NaN only
    keeps its upper bits, made quiet so that clearing the low ones cannot turn it into inf."""
    xp = backend.array_module(x)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    nan = (u & 0x7F800000) == 0x7F800000
    nan &= (u & 0x007FFFFF) != 0
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
    out = xp.where(nan, (u | 0x00400000) & 0xFFFF0000, rounded).astype(xp.uint32)
    return out.view(xp.float32)


def round_to(x, p: Precision):
    """x rounded to p's values, kept in p's compute dtype (float32; float64 for fp64): what a product of
    p-format inputs accumulated in fp32 gives once it is rounded (Precision.compute)."""
    xp = backend.array_module(x)
    if p.name == "bf16":
        return round_bf16(x)
    if p.name == "fp16":                              # past 65504 is inf: the format, not a mistake
        return narrow(xp.asarray(x, dtype=xp.float32), xp.float16).astype(xp.float32)
    return xp.asarray(x, dtype=p.compute)


def storage_dtype(p: Precision, xp=numpy):
    """The dtype p's arrays are stored in on array module xp: bf16 is ml_dtypes.bfloat16 on NumPy and
    float32 (values rounded to bf16) on CuPy; fp16 float16 on both."""
    if p.name == "bf16":
        return bfloat16() if xp is numpy else xp.dtype(xp.float32)
    return xp.dtype(p.dtype)


def to_storage(x, p: Precision):
    """x in p's storage (rounded to nearest, ties to even)."""
    xp = backend.array_module(x)
    if p.name == "bf16":
        rounded = round_bf16(x)
        return rounded.astype(bfloat16()) if xp is numpy else rounded    # exact: already bf16's values
    return narrow(xp.asarray(x), storage_dtype(p, xp))


def stored_bytes(p: Precision, xp=numpy) -> int:
    """Bytes per value of p's storage on xp (bf16 emulated on CuPy takes fp32's 4)."""
    return storage_dtype(p, xp).itemsize

