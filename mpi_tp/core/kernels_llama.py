"""Pure forward/backward kernels of the Llama architecture: RMSNorm, rotary position embeddings, SwiGLU.

The same contract as mpi_tp.core.kernels (llm.c's pairs): `out, cache = X_forward(...)`,
`grads = X_backward(dout, cache)`; no MPI, no classes, no state; fresh gradients, inputs and
caches never modified; NumPy or CuPy (the module comes from the input); the input's dtype kept.

Legend (docs/notation.md): B = batch, S = sequence, C = channels, H = heads, hs = head size,
F = MLP width; under tensor parallelism the caller passes rank i's shards (H_i heads, F_i columns).

    RMSNorm    out = x / sqrt(mean(x^2) + eps) * w                  (Zhang & Sennrich 2019)
    RoPE       out = x * cos + rotate_half(x) * sin                   (Su et al. 2021; the Hugging
               rotate_half([x1, x2]) = [-x2, x1]: dimension j of a    Face / Llama layout: the two
               head is paired with dimension j + hs/2                 halves of a head, not
                                                                      interleaved pairs)
    SwiGLU     out = silu(gate) * up, silu(g) = g * sigmoid(g)         (Shazeer 2020)
"""
from __future__ import annotations

import math

from mpi_tp.core import kernels_half as half
from mpi_tp.core.backend import array_module

# ---------------------------------------------------------------- rmsnorm

@half.in_fp32
def rmsnorm_forward(x, w, eps=1e-5):
    """Normalise over the last axis by the root mean square: out = x * rstd * w. x (..., C), w (C,)."""
    xp = array_module(x)
    C = x.shape[-1]
    ms = xp.einsum("...c,...c->...", x, x)[..., None]     # (..., C) -> (..., 1), sum of squares
    ms *= 1.0 / C
    ms += eps
    rstd = 1.0 / xp.sqrt(ms)                            # (..., 1)
    xhat = x * rstd                                     # (..., C), fresh
    return xhat * w, (xhat, w, rstd)


def rmsnorm_backward(dout, cache):
    """dx (..., C), dw (C,): the input's gradient and the weight's (B and W, mpi_tp.core.weight_grads)."""
    return rmsnorm_backward_input(dout, cache), rmsnorm_backward_weight(dout, cache)


@half.backward_of(rmsnorm_forward)
def rmsnorm_backward_weight(dout, cache):
    """dw (C,): the weight's half of rmsnorm_backward (out = xhat * w)."""
    xhat, w, _ = cache
    C = w.shape[0]
    return array_module(dout).einsum("nc,nc->c", dout.reshape(-1, C), xhat.reshape(-1, C))   # (N, C) -> (C,)


@half.backward_of(rmsnorm_forward)
def rmsnorm_backward_input(dout, cache):
    """dx (..., C): the input's half of rmsnorm_backward."""
    xhat, w, rstd = cache
    xp = array_module(dout)
    C = w.shape[0]
    dxhat = dout * w                                    # (..., C), fresh
    # xhat = x * rstd, rstd = (mean(x^2) + eps)^(-1/2)  =>  dx = rstd * (dxhat - xhat * mean(dxhat * xhat))
    proj = xp.einsum("...c,...c->...", dxhat, xhat)[..., None]             # (..., 1), times C
    proj *= 1.0 / C
    dx = dxhat
    dx -= xhat * proj
    dx *= rstd
    return dx


# ---------------------------------------------------------------- rotary position embeddings

def scaled_inv_freq(inv_freq, scaling: dict | None):
    """inv_freq (hs/2,) float64 stretched by a rope scaling (mpi_tp.model.rope_scaling checks it; None: unchanged).
    wavelen = 2 pi / inv_freq, L0 = original_max_position_embeddings:

        linear   inv_freq / factor
        llama3   wavelen < L0 / high_freq_factor: inv_freq; wavelen > L0 / low_freq_factor: inv_freq / factor;
                 between: (1 - a) inv_freq / factor + a inv_freq, a = (L0 / wavelen - low) / (high - low)
    (dynamic changes theta for each sequence length instead: dynamic_theta, in rope_tables)
    """
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    xp = array_module(inv_freq)
    L0, low, high = scaling["original_max_position_embeddings"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    a = (L0 / wavelen - low) / (high - low)
    between = (1 - a) * inv_freq / factor + a * inv_freq
    return xp.where(wavelen < L0 / high, inv_freq, xp.where(wavelen > L0 / low, inv_freq / factor, between))


def dynamic_theta(theta: float, hs: int, scaling: dict, lengths):
    """rope_type dynamic's base for sequences of these lengths (an integer array, NumPy or CuPy), as transformers'
    _compute_dynamic_ntk_parameters: theta' = theta ((factor L / L0) - (factor - 1)) ^ (hs / (hs - 2)), L = max(length,
    L0), L0 = original_max_position_embeddings (transformers' max_position_embeddings). float64, lengths' shape."""
    if hs <= 2:
        raise ValueError(f"rope_type dynamic raises theta to hs / (hs - 2): it needs a head size above 2, got {hs}")
    factor, L0 = scaling["factor"], scaling["original_max_position_embeddings"]
    L = array_module(lengths).maximum(lengths.astype("float64"), L0)
    return float(theta) * ((factor * L / L0) - (factor - 1)) ** (hs / (hs - 2))


def rope_tables(positions, hs: int, theta: float, dtype, scaling=None, lengths=None):
    """cos, sin (..., hs) for integer positions (...) (NumPy or CuPy): angle p / theta^(2j/hs) at dimension j
    and at j + hs/2 alike (Llama's `cat(freqs, freqs)`), computed in float64, then cast to dtype; scaling: the
    frequencies stretched (mpi_tp.model.rope_scaling), None: as they are. rope_type dynamic: `lengths`, the length
    of the sequence each angle is made for (an int for all, or an array broadcastable to positions), sets theta
    (dynamic_theta)."""
    xp = array_module(positions)
    if hs % 2:
        raise ValueError(f"rotary embeddings need an even head size, got {hs}")
    exponent = xp.arange(0, hs, 2, dtype="float64") / hs                           # (hs/2,): 2j / hs
    if scaling is not None and scaling["rope_type"] == "dynamic":
        if lengths is None:
            raise ValueError("rope_type dynamic: the sequence length the angles are made for is needed (lengths)")
        base = dynamic_theta(theta, hs, scaling, xp.asarray(lengths))               # (...) or ()
        inv_freq = 1.0 / base[..., None] ** exponent                                # (..., hs/2)
    else:
        inv_freq = scaled_inv_freq(1.0 / (float(theta) ** exponent), scaling)      # (hs/2,)
    angles = positions.astype("float64")[..., None] * inv_freq                     # (..., hs/2)
    angles = xp.concatenate([angles, angles], axis=-1)                             # (..., hs)
    return xp.cos(angles).astype(dtype), xp.sin(angles).astype(dtype)


def _rotate_half(x):
    """[x1, x2] -> [-x2, x1] over the last axis (halves of hs/2): a rotation by 90 degrees in each pair."""
    xp = array_module(x)
    half = x.shape[-1] // 2
    return xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope_forward(x, cos, sin):
    """Rotate each pair (j, j + hs/2) of the last axis by its angle: out = x * cos + rotate_half(x) * sin.
    x (..., S, hs); cos, sin broadcastable to x, e.g. (S, hs), or (B, 1, 1, hs) for one position per row.
    16-bit x: in fp32, rounded once (kernels_half)."""
    if half.is_half(x):                                 # the cache is the tables either way (linear in x)
        out, _ = rope_forward(half.widen(x), *(half.widen(t) if half.is_half(t) else t for t in (cos, sin)))
        return half.narrow(out, x.dtype), (cos, sin)
    out = x * cos
    out += _rotate_half(x) * sin
    return out, (cos, sin)


def rope_backward(dout, cache):
    """dx: the inverse rotation of dout (a rotation's transpose is its inverse). The same angle at j and at
    j + hs/2 lets sin commute with rotate_half, whose transpose is its negative: dx = dout cos - R(dout) sin."""
    if half.is_half(dout):
        tables = tuple(half.widen(t) if half.is_half(t) else t for t in cache)
        return half.narrow(rope_backward(half.widen(dout), tables), dout.dtype)
    cos, sin = cache
    dx = dout * cos
    dx -= _rotate_half(dout) * sin
    return dx


# ---------------------------------------------------------------- swiglu

def _sigmoid(g, xp):
    """1 / (1 + exp(-g)) without overflow warnings: exp of a non-positive number only."""
    e = xp.exp(-xp.abs(g))                              # (0, 1]
    return xp.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(g.dtype, copy=False)


@half.in_fp32
def swiglu_forward(gate, up):
    """out = silu(gate) * up, silu(g) = g * sigmoid(g). gate, up (..., F) -> out (..., F)."""
    xp = array_module(gate)
    s = _sigmoid(gate, xp)                              # kept for the backward
    silu = gate * s
    return silu * up, (gate, up, s, silu)


@half.backward_of(swiglu_forward)
def swiglu_backward(dout, cache):
    """[dgate | dup] (..., 2F): the gradient of the fused gate|up GEMM's output, written in place (no
    concatenation). silu'(g) = s + g s (1 - s) = s (1 + g (1 - s))."""
    gate, up, s, silu = cache
    xp = array_module(dout)
    F = gate.shape[-1]
    dgu = xp.empty(gate.shape[:-1] + (2 * F,), dtype=dout.dtype)
    dgate, dup = dgu[..., :F], dgu[..., F:]
    xp.multiply(dout, silu, out=dup)
    xp.subtract(1.0, s, out=dgate)
    dgate *= gate
    dgate += 1.0
    dgate *= s
    dgate *= up
    dgate *= dout
    return dgu

