"""Causal self-attention's kernels: softmax(q k^T / sqrt(hs)) v per head, forward and backward, computed in
blocks of query rows that skip the keys a causal query never sees.

Legend (docs/notation.md): B = batch, H = heads, S = sequence, hs = head size; Q = QUERY_BLOCK rows.

    dense (S <= Q)            one (S, S) product per head; the upper triangle masked to -inf
    blocked (S > Q)           query rows [a, b) against keys [0, b) only:

        keys ->  [0 ........ b)
        rows a   [ full   | tri ]        each block: (b - a, b) scores, the diagonal part (tri)
         ...     [        |     ]        masked; the keys after b never computed: about half
        rows b   [........|.....]        the two GEMMs and the softmax's passes at long S

Both keep the same cache: the probabilities (B, H, S, S), zero above the diagonal, so selective
recomputation, the dropout masks (bool, the same (S, S) positions) and the activation count
(mpi_tp.planning.activations) are what they were. The backward takes the same blocks: dv and dk
accumulate over the query blocks that see each key. At S <= Q one block is the whole sequence:
the two paths are the same arithmetic there (tests/test_kernels_attention.py checks the blocked
path against the dense one and against finite differences).
"""
from __future__ import annotations

import math

from mpi_tp.core.backend import array_module

QUERY_BLOCK = 128        # query rows per block; at most this many rows, the dense (S, S) path


_BIAS = {}


def _causal_bias(S, dtype, xp):
    """(S, S): 0 where key s <= query t, -inf above the diagonal (made once per size and dtype)."""
    key = (S, str(dtype), xp.__name__)
    if key not in _BIAS:
        bias = xp.zeros((S, S), dtype=dtype)
        bias[xp.arange(S)[None, :] > xp.arange(S)[:, None]] = -math.inf
        _BIAS[key] = bias
    return _BIAS[key]


def attention_forward(q, k, v, drop_mask=None, drop_scale=1.0, block: int | None = None):
    """Causal softmax(q k^T / sqrt(hs)) v per head. q, k, v (B, H, S, hs) -> out (B, H, S, hs).
    (Any leading axes broadcast: grouped-query attention passes q (B, H_kv, R, S, hs), k and v (B, H_kv, 1, S, hs).)

    Attention dropout: drop_mask, if given, is bool and broadcastable to (B, H, S, S), True
    where a probability is kept; the kept probabilities are scaled by drop_scale, 1/(1-p):
    out = ((probs * drop_mask) @ v) * drop_scale (the scale on the (S, hs) product, not the
    (S, S) probabilities; nothing scaled is kept). block: query rows per block (default QUERY_BLOCK: the
    module docstring).
    """
    xp = array_module(q)
    block = QUERY_BLOCK if block is None else block
    S, hs = q.shape[-2:]
    scale = 1.0 / math.sqrt(hs)
    drop_scale = float(drop_scale)                     # a Python float: a float64 scalar must not upcast
    lead = _lead(q, k)
    probs = xp.zeros(lead + (S, S), dtype=q.dtype) if S > block else None   # (B, H, S, S), 0 above the diagonal
    out = xp.empty(lead + (S, hs), dtype=q.dtype) if S > block else None
    qs = q * scale if S > block else None               # (scaling q, (S, hs), is cheaper than the scores)
    for a in range(0, S, block):
        b = min(S, a + block)
        if S <= block:                                  # one block: the whole (S, S), no copies
            att = (q * scale) @ k.swapaxes(-1, -2)      # (B, H, S, hs) @ (B, H, hs, S) -> (B, H, S, S)
        else:
            att = qs[..., a:b, :] @ k[..., :b, :].swapaxes(-1, -2)      # (B, H, b - a, b): keys up to b only
        att[..., a:b] += _causal_bias(b - a, att.dtype, xp)   # position t sees keys s <= t only
        # stable softmax over keys, in place; the diagonal is never masked so the max is finite
        att -= att.max(axis=-1, keepdims=True)
        xp.exp(att, out=att)
        att *= 1.0 / (att @ xp.ones(b, dtype=att.dtype))[..., None]   # row sums by BLAS
        kept = att if drop_mask is None else att * drop_mask[..., a:b, :b]   # bool -> probs' dtype
        if S <= block:
            probs, out = att, kept @ v                  # (B, H, S, S) @ (B, H, S, hs) -> (B, H, S, hs)
        else:
            probs[..., a:b, :b] = att
            out[..., a:b, :] = kept @ v[..., :b, :]
    if drop_mask is not None:
        out *= drop_scale
    return out, (q, k, v, probs, drop_mask, drop_scale, scale, block)


def attention_backward(dout, cache):
    """dq, dk, dv, like q, k and v: the forward's blocks again (see the module docstring)."""
    q, k, v, probs, drop_mask, drop_scale, scale, block = cache
    xp = array_module(dout)
    S = q.shape[-2]
    if drop_mask is not None:
        dout = dout * drop_scale                       # out = (probs_kept @ v) * drop_scale, on (S, hs)
    lead = _lead(q, k)
    dq = xp.empty(lead + q.shape[-2:], dtype=q.dtype) if S > block else None
    dk = xp.zeros(lead + k.shape[-2:], dtype=q.dtype) if S > block else None
    dv = xp.zeros(lead + v.shape[-2:], dtype=q.dtype) if S > block else None
    for a in range(0, S, block):
        b = min(S, a + block)
        rows, keys = (slice(None), slice(None)) if S <= block else (slice(a, b), slice(0, b))
        p, g = probs[..., rows, keys], dout[..., rows, :]
        mask = None if drop_mask is None else drop_mask[..., rows, keys]
        kept = p if mask is None else p * mask          # recomputed, not cached
        dv_part = kept.swapaxes(-1, -2) @ g            # out = kept @ v: (B, H, b, rows) @ (B, H, rows, hs)
        datt = g @ v[..., keys, :].swapaxes(-1, -2)    # (B, H, rows, hs) @ (B, H, hs, b) -> (B, H, rows, b)
        if mask is not None:
            datt *= mask                               # kept = probs * drop_mask
        # softmax: datt = p * (dp - sum_s dp * p); a masked entry's probability is 0
        datt -= xp.einsum("...ts,...ts->...t", datt, p)[..., None]   # (B, H, rows, 1), no (S, S) temporary
        datt *= p
        # att = (q * scale) @ k^T: the scale goes on the (S, hs) results, not on (S, S)
        dq_part = datt @ k[..., keys, :]               # (B, H, rows, b) @ (B, H, b, hs) -> (B, H, rows, hs)
        dq_part *= scale
        dk_part = datt.swapaxes(-1, -2) @ q[..., rows, :]    # (B, H, b, rows) @ (B, H, rows, hs)
        if S <= block:
            dq, dk, dv = dq_part, dk_part, dv_part
        else:
            dq[..., a:b, :] = dq_part
            dk[..., :b, :] += dk_part
            dv[..., :b, :] += dv_part
    dk *= scale
    # grouped-query attention broadcasts k and v over the query heads that share them (a size-1 axis:
    # ParallelAttention.grouped): their gradients are the sums over those heads
    return dq, _sum_to(dk, k.shape), _sum_to(dv, v.shape)


def _lead(q, k) -> tuple:
    """The leading axes of q's and k's broadcast (B, H) or (B, H_kv, R) (each a size or 1)."""
    return tuple(map(max, q.shape[:-2], k.shape[:-2]))


def _sum_to(d, shape):
    """d summed over the axes where `shape` has 1 and d does not (the axes a product broadcast)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(d.shape, shape)) if b == 1 and a != 1)
    return d.sum(axis=axes, keepdims=True) if axes else d
