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

The model runs the online softmax from ONLINE_FROM positions instead (mpi_tp.core.kernels_online: tiles,
no (S, S) array kept, dropout masks drawn per tile). With a sliding window (mpi_tp.core.attention_span) a
block's keys start at the first one its queries see; the probabilities outside the band stay 0.
"""
from __future__ import annotations

import math

from mpi_tp.core import attention_span as span
from mpi_tp.core import kernels_fused as fused
from mpi_tp.core import kernels_half as half
from mpi_tp.core.backend import array_module

QUERY_BLOCK = 128        # query rows per block; at most this many rows, the dense (S, S) path
ONLINE_FROM = 4096       # positions from which the model runs the online softmax (online_attention_*): the
#                          probabilities would be 64 MiB per head and sequence, and both forms took about
#                          the same time there (docs/performance.md)
CHUNK_BYTES = 1 << 18    # probabilities per chunk of batch rows in the backward (_batch_rows): 256 KiB


@half.in_fp32
def attention_forward(q, k, v, drop_mask=None, drop_scale=1.0, block: int | None = None, window: int | None = None):
    """Causal softmax(q k^T / sqrt(hs)) v per head. q, k, v (B, H, S, hs) -> out (B, H, S, hs).
    (Any leading axes broadcast: grouped-query attention passes q (B, H_kv, R, S, hs), k and v (B, H_kv, 1, S, hs).)
    16-bit q, k, v: the fp32 computation rounded once, the probabilities kept in 16 bits (mpi_tp.core.kernels_half).

    Attention dropout: drop_mask, if given, is bool and broadcastable to (B, H, S, S), True
    where a probability is kept; the kept probabilities are scaled by drop_scale, 1/(1-p):
    out = ((probs * drop_mask) @ v) * drop_scale (the scale on the (S, hs) product, not the
    (S, S) probabilities; nothing scaled is kept). block: query rows per block (default QUERY_BLOCK: the
    module docstring). window: a query sees its `window` latest keys only (mpi_tp.core.attention_span; the
    blocks then start at the window's first key).
    """
    xp = array_module(q)
    block = QUERY_BLOCK if block is None else block
    S, hs = q.shape[-2:]
    scale = 1.0 / math.sqrt(hs)
    drop_scale = float(drop_scale)                     # a Python float: a float64 scalar must not upcast
    lead = _lead(q, k)
    probs = xp.zeros(lead + (S, S), dtype=q.dtype) if S > block else None   # (B, H, S, S), 0 where not seen
    out = xp.empty(lead + (S, hs), dtype=q.dtype) if S > block else None
    qs = q * scale if S > block else None               # (scaling q, (S, hs), is cheaper than the scores)
    for a, b, lo in _blocks(S, block, window):
        if S <= block:                                  # one block: the whole (S, S), no copies
            att = (q * scale) @ k.swapaxes(-1, -2)      # (B, H, S, hs) @ (B, H, hs, S) -> (B, H, S, S)
        else:
            att = qs[..., a:b, :] @ k[..., lo:b, :].swapaxes(-1, -2)    # (B, H, b - a, b - lo): keys lo ... b - 1
        bias = span.tile_bias(a, b - a, lo, b - lo, window, att.dtype, xp)
        if bias is not None:
            att += bias                                 # position t sees keys s <= t (and t - s < window) only
        att = softmax_rows(att)                         # the diagonal is never masked: every row has a key
        kept = att if drop_mask is None else att * drop_mask[..., a:b, lo:b]   # bool -> probs' dtype
        if S <= block:
            probs, out = att, kept @ v                  # (B, H, S, S) @ (B, H, S, hs) -> (B, H, S, hs)
        else:
            probs[..., a:b, lo:b] = att
            out[..., a:b, :] = kept @ v[..., lo:b, :]
    if drop_mask is not None:
        out *= drop_scale
    return out, (q, k, v, probs, drop_mask, drop_scale, scale, block, window)


def _blocks(S: int, block: int, window: int | None):
    """(a, b, lo) of each block of query rows [a, b): its keys are lo ... b - 1 (one block when S <= block)."""
    if S <= block:
        yield 0, S, 0
        return
    for a in range(0, S, block):
        b = min(S, a + block)
        yield a, b, span.key_span(a, b - a, window)[0]


def softmax_rows(att):
    """The stable softmax over the last axis of masked scores (-inf where masked, a finite score in every
    row): in place on the CPU, as two fused kernels on a GPU (kernels_fused). Returns the probabilities."""
    xp = array_module(att)
    ones = xp.ones(att.shape[-1], dtype=att.dtype)
    att = _shifted_exp(att, att.max(axis=-1, keepdims=True))
    if xp.__name__ != "numpy":
        return fused.scale_rows(att, (att @ ones)[..., None])
    att *= 1.0 / (att @ ones)[..., None]               # row sums by BLAS
    return att


def _shifted_exp(s, shift):
    """e^(s - shift), in place on the CPU (s is a fresh temporary), one fused kernel on a GPU."""
    xp = array_module(s)
    if xp.__name__ != "numpy":
        return fused.softmax_exp(s, shift)
    s -= shift
    return xp.exp(s, out=s)


def _softmax_backward(dp, row_dot, p):
    """(dp - row_dot) p, the softmax's backward given the rows' sums of dp p: in place on the CPU (dp is a fresh
    temporary), one fused kernel on a GPU."""
    if array_module(dp).__name__ != "numpy":
        return fused.softmax_backward_tail(dp, row_dot, p)
    dp -= row_dot
    dp *= p
    return dp


@half.backward_of(attention_forward)
def attention_backward(dout, cache):
    """dq, dk, dv, like q, k and v: the forward's blocks again (see the module docstring), a few batch rows at
    a time on the CPU (_batch_rows: the (S, S) temporaries of one chunk stay in L2)."""
    q, k, v, probs, drop_mask, drop_scale, scale, block, window = cache
    xp = array_module(dout)
    if drop_mask is not None:
        dout = dout * drop_scale                       # out = (probs_kept @ v) * drop_scale, on (S, hs)
    lead = _lead(q, k)
    dq = xp.empty(lead + q.shape[-2:], dtype=q.dtype)
    dk = xp.empty(lead + k.shape[-2:], dtype=q.dtype)
    dv = xp.empty(lead + v.shape[-2:], dtype=q.dtype)
    per_row = drop_mask is not None and drop_mask.ndim == probs.ndim and drop_mask.shape[0] == probs.shape[0]
    for r in _batch_rows(probs, q, k, v, dout):
        mask = drop_mask[r] if per_row else drop_mask                   # (a broadcast mask: whole, every row)
        _backward_rows(dout[r], q[r], k[r], v[r], probs[r], mask, scale, block, window, dq[r], dk[r], dv[r])
    dk *= scale
    # grouped-query attention broadcasts k and v over the query heads that share them (a size-1 axis:
    # ParallelAttention.grouped): their gradients are the sums over those heads
    return dq, _sum_to(dk, k.shape), _sum_to(dv, v.shape)


def _batch_rows(probs, *others):
    """Slices of the first axis, each holding at most CHUNK_BYTES of probabilities, on the CPU; one slice of
    everything on a GPU, where q, k, v or dout broadcasts that axis, or where one row alone holds more
    (shape c's 16 heads: 1 MiB a row, 1.20x slower by rows). The backward's (S, S)-sized temporaries then
    stay in the core's cache: (B, H, S) = (8, 4, 128) and (8, 8, 128) float32 took 0.84x and 0.86x the
    time of the whole batch at once (Intel Xeon, experiments/kernels/attention_forms.py). Each head's arithmetic
    is unchanged, so the results are the same bits."""
    n = probs.shape[0]
    per_row = probs.nbytes // max(n, 1)
    if array_module(probs).__name__ != "numpy" or any(a.shape[0] != n for a in others):
        return [slice(None)]
    rows = CHUNK_BYTES // max(per_row, 1)
    if rows < 1:                                       # one row alone is past the budget: no gain measured
        return [slice(None)]
    return [slice(a, a + rows) for a in range(0, n, rows)]


def _backward_rows(dout, q, k, v, probs, drop_mask, scale, block, window, dq, dk, dv):
    """attention_backward on some batch rows: dq, dk (without the scale) and dv written into the given arrays."""
    xp = array_module(dout)
    S = q.shape[-2]
    if S > block:
        dk[...] = 0
        dv[...] = 0
    for a, b, lo in _blocks(S, block, window):
        rows, keys = (slice(None), slice(None)) if S <= block else (slice(a, b), slice(lo, b))
        p, g = probs[..., rows, keys], dout[..., rows, :]
        mask = None if drop_mask is None else drop_mask[..., rows, keys]
        kept = p if mask is None else p * mask          # recomputed, not cached
        datt = g @ v[..., keys, :].swapaxes(-1, -2)    # (B, H, rows, hs) @ (B, H, hs, keys) -> (B, H, rows, keys)
        if mask is not None:
            datt *= mask                               # kept = probs * drop_mask
        # softmax: datt = p * (dp - sum_s dp * p); a masked entry's probability is 0
        datt = _softmax_backward(datt, xp.einsum("...ts,...ts->...t", datt, p)[..., None], p)   # no (S, S) temporary
        # att = (q * scale) @ k^T: the scale goes on the (S, hs) results, not on (S, S)
        if S <= block:                                 # one block: straight into the outputs
            xp.matmul(kept.swapaxes(-1, -2), g, out=dv)    # out = kept @ v: (B, H, S, S) @ (B, H, S, hs)
            xp.matmul(datt, k, out=dq)                      # (B, H, S, S) @ (B, H, S, hs)
            xp.matmul(datt.swapaxes(-1, -2), q, out=dk)
        else:
            dv[..., keys, :] += kept.swapaxes(-1, -2) @ g   # (B, H, keys, rows) @ (B, H, rows, hs)
            dq[..., a:b, :] = datt @ k[..., keys, :]        # (B, H, rows, keys) @ (B, H, keys, hs)
            dk[..., keys, :] += datt.swapaxes(-1, -2) @ q[..., rows, :]
    dq *= scale


def _lead(q, k) -> tuple:
    """The leading axes of q's and k's broadcast (B, H) or (B, H_kv, R) (each a size or 1)."""
    return tuple(map(max, q.shape[:-2], k.shape[:-2]))


def _sum_to(d, shape):
    """d summed over the axes where `shape` has 1 and d does not (the axes a product broadcast)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(d.shape, shape)) if b == 1 and a != 1)
    return d.sum(axis=axes, keepdims=True) if axes else d
