"""What MPI carries for each number format: float16 natively, bfloat16 as its 16-bit words.

MPI has no bfloat16 type (MPICH's MPIX_C_FLOAT16 and Open MPI's are binary16 only), and mpi4py cannot
read ml_dtypes' bfloat16 arrays. So a bfloat16 buffer travels as its uint16 words (`wire`: a view, no
copy) and its sums use a reduction of our own (`reduction`): each pair of contributions widened to
float32, added, rounded once back to bfloat16 (to nearest, ties to even: mpi_tp.core.precision), which
is what a GPU's bfloat16 all-reduce does at every step of its ring. A sum over P ranks therefore rounds
P - 1 times, in the order MPI chooses: within (P - 1) u sum |x_i| of the exact sum (u = 2^-8, bfloat16's
unit roundoff; tests/test_formats.py checks the bound). float16 goes as itself: both MPI libraries
reduce it (in their own arithmetic, within the same kind of bound with u = 2^-11).
"""
from __future__ import annotations

import numpy
from mpi4py import MPI

from mpi_tp.core.precision import is_bf16, round_bf16

_BF16_SUM = None


def wire(buf):
    """The buffer as MPI should read it: a bfloat16 array's uint16 view, anything else itself."""
    return buf.view(numpy.uint16) if is_bf16(buf) else buf


def reduction(op, x):
    """The MPI operation that applies `op` to arrays like x: op itself, or for bfloat16 the sum above."""
    if not is_bf16(x):
        return op
    if op != MPI.SUM:
        raise ValueError("bfloat16 buffers are reduced by sum only (MPI has no bfloat16 type)")
    global _BF16_SUM
    if _BF16_SUM is None:
        _BF16_SUM = MPI.Op.Create(_bf16_sum, commute=True)
    return _BF16_SUM


def words_to_float32(words):
    """bfloat16 bits (uint16) as float32 values, exactly (bfloat16 is float32's upper half)."""
    return (words.astype(numpy.uint32) << 16).view(numpy.float32)


def _bf16_sum(inbuf, inoutbuf, datatype) -> None:
    """inout = bf16(float32(in) + float32(inout)), element by element, on the buffers' uint16 words."""
    a = numpy.frombuffer(inbuf, dtype=numpy.uint16)
    b = numpy.frombuffer(inoutbuf, dtype=numpy.uint16)
    total = round_bf16(words_to_float32(a) + words_to_float32(b))
    b[...] = (total.view(numpy.uint32) >> 16).astype(numpy.uint16)
