"""Pure forward/backward kernels for a GPT: no MPI, no classes, no global state.

Every layer is a pair, as in llm.c:

    out, cache = X_forward(inputs...)
    grads      = X_backward(dout, cache)

Backward returns freshly allocated gradients and never accumulates; the layer
objects that own parameters add them into their own `.grad` buffers. Kernels
never modify their inputs or their cache, so a backward may be called twice.
They run unchanged on NumPy and CuPy arrays (the module comes from the input)
and keep the input dtype: float32 in, float32 out and float32 gradients.

Legend (docs/notation.md): B = batch, S = sequence, C = channels, H = heads, hs = head size (C/H),
V = vocab, K = input features, O = output features, N = number of rows (the
product of all leading axes, e.g. B*S). Under tensor parallelism the caller
passes rank i's shards (e.g. H_i of the H heads, O_i of the O columns); the kernels
do not care.
"""
from __future__ import annotations

from mpi_tp.core import kernels_fused as fused
from mpi_tp.core import kernels_half as half
from mpi_tp.core.backend import array_module
from mpi_tp.core.blas import matmul
from mpi_tp.core.kernels_attention import (  # noqa: F401
    _sum_to,
    attention_backward,
    attention_forward,
)
from mpi_tp.core.kernels_fused import GELU_CUBIC, GELU_SCALE
from mpi_tp.core.kernels_loss import cross_entropy_backward, cross_entropy_forward  # noqa: F401
from mpi_tp.core.segment import segment_sum

CHUNK = 1 << 15          # elements per chunk of multi-pass elementwise work on the CPU (_chunks): 128 KB of
#                          float32 per array, in L2 on both Intel (1.25 MB) and AMD EPYC (512 KB) cores


# ---------------------------------------------------------------- linear

FEW_ROWS = 128           # up to this many rows, a weight stored (out, in) is the GEMM's left operand (below)
SMALL_GEMM = 1_000_000   # multiply-adds of a product that OpenBLAS's small-matrix kernels take unpacked (SkylakeX)
PANEL_ROWS = 8           # at most this many rows go by panels (_few_rows); more: one call (MKL's was faster)


def linear_forward(x, w, b=None):
    """out = x @ w + b. x (..., K), w (K, O), b (O,) or None.

    w is stored (in, out), or (out, in) as w = w_t.T with w_t contiguous (PyTorch's nn.Linear layout; a
    decoder's weights, mpi_tp.core.params.store_out_in, and the tied output layer's wte). With few rows
    (decoding: one position per sequence) the second is computed as (w_t @ x^T)^T (_few_rows): OpenBLAS's
    GEMM packs its operands and its kernel is 16 rows tall, so x @ w with 4 rows runs at a fraction of the
    weight-read speed. Same product, other summation order: within float rounding. 16-bit x (bf16, fp16):
    mpi_tp.core.kernels_half, fp32 accumulation rounded once."""
    if half.is_half(x):
        return half.linear_forward(x, w, b, product)
    K, O = w.shape
    out = product(x.reshape(-1, K), w)                 # (..., K) -> (N, K) @ (K, O) -> (N, O): one big GEMM
    if b is not None:
        out += b                                       # fresh temporary: safe in place
    out = out.reshape(*x.shape[:-1], O)                # (N, O) -> (..., O)
    return out, (x, w, b is not None)


def product(x2, w):
    """x2 (N, K) @ w (K, O), in the form fastest for w's layout: _few_rows for a weight stored (out, in)
    and few rows, else one GEMM (the 16-bit kernels use it on the widened operands, which keep w's layout)."""
    if x2.shape[0] <= FEW_ROWS and w.T.flags.c_contiguous and not w.flags.c_contiguous:
        return _few_rows(x2, w.T)
    return matmul(x2, w)


def _few_rows(x2, w_t):
    """x2 (N, K) @ w_t.T, w_t (O, K) contiguous, N small -> (N, O) C-ordered. The weight is the tall operand:
    (O, K) @ (K, N). On the CPU, with 2 to PANEL_ROWS rows, few enough that panels of >= 32 weight rows
    stay under SMALL_GEMM (7 rows at K 4096), the weight goes by panels to NumPy's
    OpenBLAS, whose small-matrix kernels (SkylakeX builds) multiply those without packing, close to the
    weight-read speed (the (C, 3C) weight of C 1024 times 4 rows, read from memory: 1.37 ms by panels, 2.27
    in one call, 3.50 stored (in, out); one row's GEMV 0.89; Intel Xeon, experiments/kernels/gemm_shapes.py);
    elsewhere the panels are the same product. More rows: one call (mpi_tp.core.blas: MKL's was as fast
    or faster there), as on a GPU."""
    xp = array_module(x2)
    N, K = x2.shape
    O = w_t.shape[0]
    xt = xp.ascontiguousarray(x2.T)                    # (K, N)
    if N < 2:
        return (w_t @ xt).T.copy()                     # one row: NumPy's GEMV, at the weight-read speed
    panel = SMALL_GEMM // (N * K) // 16 * 16           # weight rows per panel (the kernel's 16-row unroll)
    if N > PANEL_ROWS or panel < 32 or xp.__name__ != "numpy":
        return matmul(w_t, xt).T.copy()                # (O, K) @ (K, N) -> (O, N) -> (N, O)
    out = xp.empty((O, N), dtype=xt.dtype)
    for p in range(0, O, panel):
        xp.matmul(w_t[p:p + panel], xt, out=out[p:p + panel])
    return out.T.copy()


def linear_backward(dout, cache, dw_out=None):
    """dx (..., K), dw (K, O), db (O,) or None when the forward had no bias.

    dw_out: an array (K, O) to write dw into instead of a fresh one (the caller's
    zeroed gradient: one pass over it instead of a new array plus an addition).
    """
    x, w, has_bias = cache
    dx = linear_backward_input(dout, w)
    dw, db = linear_backward_weight(dout, x, has_bias, dw_out)
    return dx, dw, db


def linear_backward_input(dout, w):
    """dx (..., K) alone: the half of linear_backward that needs no input (out = x @ w => dx = dout @ w^T).
    Sequence parallelism runs it while the input is being all-gathered again."""
    if half.is_half(dout):
        return half.linear_backward_input(dout, w)
    K, O = w.shape
    lead = dout.shape[:-1]
    return matmul(dout.reshape(-1, O), w.T).reshape(*lead, K)   # (N, O) @ (O, K) -> (..., K)


def linear_backward_weight(dout, x, has_bias=False, dw_out=None):
    """dw (K, O) = x^T dout and db (O,) or None: the half of linear_backward that needs the input."""
    if half.is_half(dout):
        return half.linear_backward_weight(dout, x, has_bias, dw_out)
    K, O = x.shape[-1], dout.shape[-1]
    x2, dout2 = x.reshape(-1, K), dout.reshape(-1, O)      # (..., K) -> (N, K), (..., O) -> (N, O)
    dw = matmul(x2.T, dout2, out=dw_out)               # (K, N) @ (N, O) -> (K, O)
    db = dout2.sum(axis=0) if has_bias else None       # (N, O) -> (O,)
    return dw, db


# ---------------------------------------------------------------- layernorm

def _row_mean(a, xp):
    """Mean over the last axis as a matrix-vector product: (..., C) -> (..., 1).

    BLAS does this about 5x faster than a.mean(axis=-1) on (1024, 256) float32 here.
    """
    C = a.shape[-1]
    return (a @ xp.full(C, 1.0 / C, dtype=a.dtype))[..., None]


def _row_dot(a, b, xp):
    """sum over the last axis of a * b, without the (..., C) temporary: (..., C) -> (..., 1)."""
    return xp.einsum("...c,...c->...", a, b)[..., None]


@half.in_fp32
def layernorm_forward(x, w, b, eps=1e-5):
    """Normalise over the last axis (biased variance): out = (x - mean) * rstd * w + b."""
    xp = array_module(x)
    C = x.shape[-1]
    if xp.__name__ != "numpy":                         # a GPU: 6 device operations, not 11 (kernels_fused)
        centred = x - _row_mean(x, xp)
        rstd = fused.layernorm_rstd(_row_dot(centred, centred, xp), 1.0 / C, eps)
        xhat, out = fused.layernorm_forward_tail(centred, rstd, w, b)
        return out, (xhat, w, rstd)
    xhat = x - _row_mean(x, xp)                        # (..., C), fresh
    var = _row_dot(xhat, xhat, xp)                     # (..., C) -> (..., 1), times C
    var *= 1.0 / C
    var += eps
    rstd = 1.0 / xp.sqrt(var)                          # (..., 1)
    xhat *= rstd                                       # now the normalised input
    out = xhat * w
    out += b
    return out, (xhat, w, rstd)


def layernorm_backward(dout, cache):
    """dx (..., C), dw (C,), db (C,): the input's gradient and the weights' (B and W,
    mpi_tp.core.weight_grads), which a zero-bubble schedule computes at different times."""
    return (layernorm_backward_input(dout, cache),) + layernorm_backward_weight(dout, cache)


@half.backward_of(layernorm_forward)
def layernorm_backward_weight(dout, cache):
    """dw (C,), db (C,): the weights' half of layernorm_backward (out = xhat * w + b)."""
    xhat, w, _ = cache
    xp = array_module(dout)
    C = w.shape[0]
    dout2, xhat2 = dout.reshape(-1, C), xhat.reshape(-1, C)   # (..., C) -> (N, C)
    return xp.einsum("nc,nc->c", dout2, xhat2), dout2.sum(axis=0)   # (N, C) -> (C,), no temporary


@half.backward_of(layernorm_forward)
def layernorm_backward_input(dout, cache):
    """dx (..., C): the input's half of layernorm_backward."""
    xhat, w, rstd = cache
    xp = array_module(dout)
    C = w.shape[0]
    dxhat = dout * w                                   # (..., C)
    # xhat = (x - mean) * rstd, with mean and rstd depending on x too:
    # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    mean_proj = _row_dot(dxhat, xhat, xp)              # (..., C) -> (..., 1), times C
    if xp.__name__ != "numpy":                         # a GPU: 7, not 11: the tail's passes in one
        return fused.layernorm_backward_tail(dxhat, _row_mean(dxhat, xp), xhat, mean_proj, 1.0 / C, rstd)
    mean_proj *= 1.0 / C
    dx = dxhat                                         # fresh temporary, reused in place
    dx -= _row_mean(dxhat, xp)
    dx -= xhat * mean_proj
    dx *= rstd
    return dx


# ---------------------------------------------------------------- gelu

def _chunks(n: int):
    """Slices of a flat array of n elements for elementwise work done a chunk at a time on the CPU: chunks of
    CHUNK elements, so that the several passes over each stay in the cache (GELU: 0.63x the time of whole-
    array passes here). (On a GPU GELU is one fused kernel instead: kernels_fused.)"""
    return [slice(a, a + CHUNK) for a in range(0, n, CHUNK)]


@half.in_fp32
def gelu_forward(x):
    """Tanh approximation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))."""
    xp = array_module(x)
    if xp.__name__ != "numpy":                         # a GPU: one kernel (mpi_tp.core.kernels_fused)
        out, t = fused.gelu_forward_tail(x)
        return out, (x, t)
    out, t = xp.empty_like(x), xp.empty_like(x)
    xf, tf, of = x.reshape(-1), t.reshape(-1), out.reshape(-1)       # (the fresh ones: views)
    for c in _chunks(xf.size):
        xs, u, o = xf[c], tf[c], of[c]
        xp.multiply(xs, xs, out=u)                     # u built up in place
        u *= GELU_CUBIC
        u += 1.0
        u *= xs
        u *= GELU_SCALE                                # u = sqrt(2/pi) * (x + 0.044715 x^3)
        xp.tanh(u, out=u)                              # t, kept for the backward: no second tanh
        xp.add(u, 1.0, out=o)
        o *= xs
        o *= 0.5
    return out, (x, t)


@half.backward_of(gelu_forward)
def gelu_backward(dout, cache):
    """dx, same shape as x."""
    x, t = cache
    # out = 0.5 x (1 + t), t = tanh(u), u = a (x + c x^3)
    #   => dout/dx = 0.5 [(1 + t) + x (1 - t^2) a (1 + 3 c x^2)]
    xp = array_module(dout)
    if xp.__name__ != "numpy":                         # a GPU: one kernel
        return fused.gelu_backward_tail(x, t, dout)
    dx = xp.empty_like(x)
    xf, tf, gf, df = x.reshape(-1), t.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    parts = _chunks(xf.size)
    s = xp.empty(parts[0].stop - parts[0].start if parts else 0, dtype=x.dtype)
    for c in parts:
        xs, ts, d = xf[c], tf[c], df[c]
        ss = s[:xs.size]
        xp.multiply(ts, ts, out=d)
        xp.subtract(1.0, d, out=d)                     # 1 - t^2
        d *= xs
        xp.multiply(xs, xs, out=ss)
        ss *= 3.0 * GELU_CUBIC * GELU_SCALE
        ss += GELU_SCALE                               # a (1 + 3 c x^2)
        d *= ss
        d += ts
        d += 1.0
        d *= gf[c]
        d *= 0.5
    return dx


# ---------------------------------------------------------------- attention: kernels_attention.py

def embedding_forward(ids, table):
    """out = table[ids]. ids integer (B, S) (any shape), table (V, C) -> out (B, S, C)."""
    out = table[ids]                                   # (B, S) -> (B, S, C)
    return out, (ids, table.shape, table.dtype)


def embedding_backward(dout, cache):
    """dtable (V, C): each row of dout added to its id's row, repeated ids summed.

    A sorted segment sum (mpi_tp.core.segment), not add.at / scatter_add: no float atomics on a
    GPU, so the gradient, and a resumed run, are the same bits run after run.
    """
    ids, shape, dtype = cache
    if half.is_half(dout):                             # 16-bit: summed in fp32, rounded once
        return half.narrow(segment_sum(ids.reshape(-1), half.widen(dout.reshape(-1, shape[1])), shape[0]), dtype)
    dout2 = dout.reshape(-1, shape[1]).astype(dtype, copy=False)   # (B, S, C) -> (N, C), summed in wte's dtype
    return segment_sum(ids.reshape(-1), dout2, shape[0])           # (N, C) -> (V, C)


# ---------------------------------------------------------------- cross-entropy: kernels_loss.py
