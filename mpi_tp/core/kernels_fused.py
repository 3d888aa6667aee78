"""The elementwise work of GELU, LayerNorm and the softmax as single functions: one kernel each on CuPy.

On a GPU every NumPy-style operation is a kernel that reads its operands from device memory and
writes its result back, so GELU's nine in-place passes (mpi_tp.core.kernels.gelu_forward) are nine
round trips where one would do. `backend.fused` compiles each function below into one kernel with
cupy.fuse when the backend is CuPy (kernels and kernels_attention call them on device arrays only);
under NumPy a function is itself, plain Python, and the CPU keeps its in-place passes, chunked to stay
in cache where that measured faster. Each function does the NumPy path's arithmetic in the NumPy
path's order, so the numbers are the same (a GPU compiler may still contract a multiply and an add
into one rounding, FMA: within float rounding). Device operations per call, as the CuPy stand-in
counts them (an upper bound on launches: allocations and fills included; tests/test_standin_kernels.py
checks the new counts):

    GELU forward       11 -> 1                 GELU backward      13 -> 1
    LayerNorm forward  11 -> 6                 LayerNorm backward 11 -> 7   (the row and column
                                                                            reductions stay their own)
    attention forward  11 -> 9                 attention backward 12 -> 11  (one query block; the
                                                                            softmax's shift and exp, its scale,
                                                                            its backward's tail; the online
                                                                            softmax's tiles the same way)
"""
from __future__ import annotations

import math

from mpi_tp.core import backend

GELU_SCALE = math.sqrt(2.0 / math.pi)  # Python floats: never upcast float32 (mpi_tp.core.kernels uses these two)
GELU_CUBIC = 0.044715


@backend.fused
def gelu_forward_tail(x):
    """(out, t): out = 0.5 x (1 + t), t = tanh(sqrt(2/pi) (x + 0.044715 x^3)), kept for the backward."""
    u = ((x * x * GELU_CUBIC + 1.0) * x) * GELU_SCALE
    t = backend.xp().tanh(u)
    return (t + 1.0) * x * 0.5, t


@backend.fused
def gelu_backward_tail(x, t, dout):
    """dx = 0.5 dout [(1 + t) + x (1 - t^2) a (1 + 3 c x^2)], a = sqrt(2/pi), c = 0.044715."""
    return (((1.0 - t * t) * x) * (x * x * (3.0 * GELU_CUBIC * GELU_SCALE) + GELU_SCALE) + t + 1.0) * dout * 0.5


@backend.fused
def layernorm_rstd(var_sum, inv_c, eps):
    """1 / sqrt(var + eps) from the rows' sums of squares (var = var_sum / C, inv_c = 1 / C): (..., 1)."""
    return 1.0 / backend.xp().sqrt(var_sum * inv_c + eps)


@backend.fused
def layernorm_forward_tail(centred, rstd, w, b):
    """(xhat, out): xhat = (x - mean) rstd, out = xhat w + b; centred (..., C), rstd (..., 1), w and b (C,)."""
    xhat = centred * rstd
    return xhat, xhat * w + b


@backend.fused
def layernorm_backward_tail(dxhat, row_mean, xhat, proj_sum, inv_c, rstd):
    """dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)); mean(dxhat) (..., 1) computed before, and
    mean(dxhat xhat) = proj_sum inv_c here (inv_c = 1 / C)."""
    return ((dxhat - row_mean) - xhat * (proj_sum * inv_c)) * rstd


@backend.fused
def softmax_exp(scores, row_max):
    """e^(scores - row max): the softmax's shift and exponential (masked scores are -inf: 0)."""
    return backend.xp().exp(scores - row_max)


@backend.fused
def scale_rows(e, row_sum):
    """e / row_sum, as e (1 / row_sum) (the NumPy path's order): the softmax's normalisation."""
    return e * (1.0 / row_sum)


@backend.fused
def softmax_backward_tail(dp, row_dot, p):
    """(dp - sum_s dp p) p: the softmax's backward, given the rows' sums of dp p."""
    return (dp - row_dot) * p
