"""The linear kernels on 16-bit storage (bf16, fp16): products accumulated in fp32, rounded once.

    out, cache = linear_forward(x16, w16, b16)      # x16 (..., K), w16 (K, O): bf16 or fp16 arrays
    dx16 = linear_backward_input(dout16, w16)
    dw, db = linear_backward_weight(dout16, x16, has_bias, dw_out)   # dw_out fp32: Megatron's fp32 grads

A GPU's tensor cores multiply 16-bit inputs exactly, add the products in fp32 and round the result
once to the output's format (cuBLAS with an fp32 compute type; the bias is added in fp32 in the
same epilogue). NumPy has no 16-bit GEMM (and no bfloat16 at all: ml_dtypes adds the storage), so
the same arithmetic is written out: widen the operands to fp32 (exact: every 16-bit value is an fp32
value), multiply in fp32 with the BLAS, add the bias, round once to the input's format (to nearest,
ties to even: mpi_tp.core.precision). The inputs stay 16-bit in the cache, so a layer keeps half the
bytes of an fp32 one for its backward; the widened copies live only inside a call. Summing in another
order (another BLAS, a GPU) can move a result by one unit in the last place of the 16-bit format:
tests/test_kernels_half.py compares with PyTorch within that.

mpi_tp.core.kernels sends 16-bit arrays here (precision.is_half); everything else stays there.
"""
from __future__ import annotations

import functools

from mpi_tp.core.blas import matmul
from mpi_tp.core.precision import is_half, narrow, widen


def linear_forward(x, w, b=None, product=matmul):
    """out = x @ w + b in x's 16-bit format, accumulated in fp32. x (..., K), w (K, O), b (O,) or None.
    product: how to multiply the widened (N, K) and (K, O) (kernels.product: the layout's fastest form)."""
    K, O = w.shape
    out = product(widen(x.reshape(-1, K)), widen(w))             # (N, K) @ (K, O) -> (N, O), fp32
    if b is not None:
        out += widen(b)                                           # in fp32, before the one rounding
    return narrow(out, x.dtype).reshape(*x.shape[:-1], O), (x, w, b is not None)


def linear_backward_input(dout, w):
    """dx (..., K) = dout @ w^T in dout's format, accumulated in fp32."""
    K, O = w.shape
    dx = matmul(widen(dout.reshape(-1, O)), widen(w).T)           # (N, O) @ (O, K) -> (N, K), fp32
    return narrow(dx, dout.dtype).reshape(*dout.shape[:-1], K)


def linear_backward_weight(dout, x, has_bias=False, dw_out=None):
    """dw (K, O) = x^T dout and db (O,) or None, accumulated in fp32; rounded once to dout's format, or
    written into dw_out in its own dtype (an fp32 gradient buffer keeps them unrounded)."""
    K, O = x.shape[-1], dout.shape[-1]
    d32 = widen(dout.reshape(-1, O))
    dw = matmul(widen(x.reshape(-1, K)).T, d32)                   # (K, N) @ (N, O) -> (K, O), fp32
    db = d32.sum(axis=0) if has_bias else None                    # (N, O) -> (O,), fp32
    dtype = dout.dtype if dw_out is None else dw_out.dtype
    if dw_out is not None:
        dw_out[...] = dw                                          # its dtype: rounded once if 16-bit
        dw = dw_out
    else:
        dw = narrow(dw, dtype)
    return dw, (None if db is None else narrow(db, dtype))


# -- the elementwise and normalising kernels: computed in fp32 on the widened inputs, rounded once ------
# LayerNorm and RMSNorm statistics, GELU's tanh, SwiGLU's sigmoid, attention's softmax: all in fp32, as
# fused GPU kernels compute them; the output rounded once to the input's format. The cache is the fp32
# kernel's own, at the width Megatron keeps it: the activation-sized arrays (the normalised input, the
# tanh, the softmax output, the sigmoid) rounded once to the input's format, the inputs themselves as they
# came (no copy), the per-row statistics (LayerNorm's 1/std, the online softmax's log-sum-exp) in fp32. So
# a 16-bit layer keeps half the bytes of an fp32 one (mpi_tp.planning.activations counts them), and the
# backward, the fp32 backward on that cache widened, differs from the fp32 pair's by the rounding of the
# kept arrays: tests/test_kernels_half.py derives and checks the bound, kernel by kernel.


def _is_statistic(a, first) -> bool:
    """A per-row statistic of the cache, kept in fp32: fewer axes than the kernel's first input (lse
    (B, H, S) beside q (B, H, S, hs)) or a last axis of 1 (rstd (..., 1))."""
    return a.ndim < first.ndim or a.shape[-1] == 1


def forward_in_fp32(forward, *inputs, **options):
    """forward(*inputs) computed in fp32 (16-bit inputs widened), its output rounded once to the first
    input's format; the cache: the fp32 kernel's, in the same layout, narrowed as said above."""
    wide = [widen(a) if is_half(a) else a for a in inputs]
    out32, cache32 = forward(*wide, **options)
    dtype = inputs[0].dtype
    out = narrow(out32, dtype)
    same = {id(w): a for w, a in zip(wide, inputs)}                # an input: the caller's own array
    same[id(out32)] = out                                          # the output (the online softmax keeps it)

    def kept(item):
        if isinstance(item, tuple):
            return tuple(kept(i) for i in item)
        if id(item) in same:
            return same[id(item)]
        if getattr(item, "dtype", None) is None or item.dtype.kind != "f" or _is_statistic(item, wide[0]):
            return item                                            # masks, numbers, fp32 statistics
        return narrow(item, dtype)                                 # an activation: 16 bits
    return out, kept(cache32)


def backward_in_fp32(backward, dout, cache):
    """backward(dout) of forward_in_fp32's call: the fp32 backward on the kept cache widened (exact), each
    gradient rounded once to dout's format (a kernel's 16-bit inputs and dout share one format)."""
    def wide(item):
        if isinstance(item, tuple):
            return tuple(wide(i) for i in item)
        return widen(item) if is_half(item) else item
    grads = backward(widen(dout), wide(cache))
    if not isinstance(grads, tuple):
        return narrow(grads, dout.dtype)
    return tuple(None if g is None else narrow(g, dout.dtype) for g in grads)


def in_fp32(forward):
    """A kernel's forward whose 16-bit calls (its first input decides) go through forward_in_fp32."""
    @functools.wraps(forward)
    def dispatch(first, *inputs, **options):
        if is_half(first):
            return forward_in_fp32(forward, first, *inputs, **options)
        return forward(first, *inputs, **options)
    return dispatch


def backward_of(forward):
    """A kernel's backward whose 16-bit calls (dout decides) go through backward_in_fp32 (`forward`: the
    pair's forward, named on the page so that a reader sees which cache it takes)."""
    def decorate(backward):
        @functools.wraps(backward)
        def dispatch(dout, cache):
            if is_half(dout):
                return backward_in_fp32(backward, dout, cache)
            return backward(dout, cache)
        return dispatch
    return decorate
