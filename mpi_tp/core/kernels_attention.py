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

    online (the model's from ONLINE_FROM positions)   tiles of Q x Q, the keys up to the query's:

        each tile's scores merged into each row's running max m, sum l and output o (online_block),
        out = o / l; kept for the backward: out and lse = m + log l (B, H, S), not the probabilities;
        the backward recomputes each tile's p = e^(s - lse) (online_block_backward)

The online softmax never holds more than one tile of scores: at S = 4096 the blocked form keeps 64
MiB of probabilities per head and sequence, the online one 16 KiB of lse; it computes the scores twice
(tests/test_online_attention.py). Ring attention (mpi_tp.parallel.ring_attention) runs the same two
block functions over the blocks that travel around the context-parallel ring.
"""
from __future__ import annotations

import math

from mpi_tp.core import kernels_fused as fused
from mpi_tp.core import kernels_half as half
from mpi_tp.core.backend import array_module

QUERY_BLOCK = 128        # query rows per block; at most this many rows, the dense (S, S) path
ONLINE_FROM = 4096       # positions from which the model runs the online softmax (online_attention_*): the
#                          probabilities would be 64 MiB per head and sequence, and both forms took about
#                          the same time there (docs/performance.md)
CHUNK_BYTES = 1 << 18    # probabilities per chunk of batch rows in the backward (_batch_rows): 256 KiB


_BIAS = {}


def _causal_bias(S, dtype, xp):
    """(S, S): 0 where key s <= query t, -inf above the diagonal (made once per size and dtype)."""
    key = (S, str(dtype), xp.__name__)
    if key not in _BIAS:
        bias = xp.zeros((S, S), dtype=dtype)
        bias[xp.arange(S)[None, :] > xp.arange(S)[:, None]] = -math.inf
        _BIAS[key] = bias
    return _BIAS[key]


@half.in_fp32
def attention_forward(q, k, v, drop_mask=None, drop_scale=1.0, block: int | None = None):
    """Causal softmax(q k^T / sqrt(hs)) v per head. q, k, v (B, H, S, hs) -> out (B, H, S, hs).
    (Any leading axes broadcast: grouped-query attention passes q (B, H_kv, R, S, hs), k and v (B, H_kv, 1, S, hs).)
    16-bit q, k, v: the fp32 computation rounded once, the probabilities kept in 16 bits (mpi_tp.core.kernels_half).

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
        att = softmax_rows(att)                         # the diagonal is never masked: every row has a key
        kept = att if drop_mask is None else att * drop_mask[..., a:b, :b]   # bool -> probs' dtype
        if S <= block:
            probs, out = att, kept @ v                  # (B, H, S, S) @ (B, H, S, hs) -> (B, H, S, hs)
        else:
            probs[..., a:b, :b] = att
            out[..., a:b, :] = kept @ v[..., :b, :]
    if drop_mask is not None:
        out *= drop_scale
    return out, (q, k, v, probs, drop_mask, drop_scale, scale, block)


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
    q, k, v, probs, drop_mask, drop_scale, scale, block = cache
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
        _backward_rows(dout[r], q[r], k[r], v[r], probs[r], mask, scale, block, dq[r], dk[r], dv[r])
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


def _backward_rows(dout, q, k, v, probs, drop_mask, scale, block, dq, dk, dv):
    """attention_backward on some batch rows: dq, dk (without the scale) and dv written into the given arrays."""
    xp = array_module(dout)
    S = q.shape[-2]
    if S > block:
        dk[...] = 0
        dv[...] = 0
    for a in range(0, S, block):
        b = min(S, a + block)
        rows, keys = (slice(None), slice(None)) if S <= block else (slice(a, b), slice(0, b))
        p, g = probs[..., rows, keys], dout[..., rows, :]
        mask = None if drop_mask is None else drop_mask[..., rows, keys]
        kept = p if mask is None else p * mask          # recomputed, not cached
        datt = g @ v[..., keys, :].swapaxes(-1, -2)    # (B, H, rows, hs) @ (B, H, hs, b) -> (B, H, rows, b)
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
            dv[..., :b, :] += kept.swapaxes(-1, -2) @ g    # (B, H, b, rows) @ (B, H, rows, hs)
            dq[..., a:b, :] = datt @ k[..., keys, :]        # (B, H, rows, b) @ (B, H, b, hs)
            dk[..., :b, :] += datt.swapaxes(-1, -2) @ q[..., rows, :]
    dq *= scale


def _lead(q, k) -> tuple:
    """The leading axes of q's and k's broadcast (B, H) or (B, H_kv, R) (each a size or 1)."""
    return tuple(map(max, q.shape[:-2], k.shape[:-2]))


def _sum_to(d, shape):
    """d summed over the axes where `shape` has 1 and d does not (the axes a product broadcast)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(d.shape, shape)) if b == 1 and a != 1)
    return d.sum(axis=axes, keepdims=True) if axes else d


# ---------------------------------------------------------------- the online softmax (no (S, S) array kept)

def online_block(qs, k, v, rows, cols, diag, m, l, o, mask=None, drop_scale=1.0):
    """One block of the online softmax (Milakov and Gimelshein 2018; FlashAttention's merge): the scores of
    the queries `rows` (qs: q already scaled) against the keys `cols`, merged into the running maximum m,
    sum l and output o of those rows, in place:

        m' = max(m, max_j s_j)      l' = l e^(m - m') + sum_j e^(s_j - m')      o' = o e^(m - m') + e^(s - m') v

    diag: the block straddles the diagonal (key j > query i masked). mask: the block's bool dropout mask,
    the kept probabilities times drop_scale enter o (not l). At the end out = o / l, lse = m + log l."""
    xp = array_module(qs)
    s = qs[..., rows, :] @ k[..., cols, :].swapaxes(-1, -2)
    if diag:
        s += _causal_bias(s.shape[-1], s.dtype, xp)
    m_new = xp.maximum(m[..., rows], s.max(axis=-1))
    p = _shifted_exp(s, m_new[..., None])
    corr = xp.exp(m[..., rows] - m_new)
    l[..., rows] = l[..., rows] * corr + p.sum(axis=-1)
    if mask is not None:
        p *= mask
        p *= drop_scale
    o[..., rows, :] = o[..., rows, :] * corr[..., None] + p @ v[..., cols, :]
    m[..., rows] = m_new


def online_block_backward(qs, q, k, v, rows, cols, diag, lse, delta, dout, dq, dk, dv, mask=None, drop_scale=1.0):
    """One block's share of the gradients (FlashAttention's backward): p = e^(s - lse) again from q and k,
    dp = dout v^T, ds = p (dp - delta) with delta = rowsum(dout * out); dq[rows] += ds k scale, dk[cols] += ds^T q
    scale, dv[cols] += p_kept^T dout, summed over broadcast (grouped-query) axes to dk's and dv's shapes."""
    xp = array_module(qs)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = qs[..., rows, :] @ k[..., cols, :].swapaxes(-1, -2)
    if diag:
        s += _causal_bias(s.shape[-1], s.dtype, xp)
    p = _shifted_exp(s, lse[..., rows, None])
    g = dout[..., rows, :]
    dp = g @ v[..., cols, :].swapaxes(-1, -2)
    kept = p
    if mask is not None:
        kept = p * mask * drop_scale
        dp *= mask
        dp *= drop_scale
    n = cols.stop - cols.start
    dv[..., cols, :] += _sum_to(kept.swapaxes(-1, -2) @ g, dv.shape[:-2] + (n, dv.shape[-1]))
    dp = _softmax_backward(dp, delta[..., rows, None], p)                # ds
    dq[..., rows, :] += (dp @ k[..., cols, :]) * scale
    d = _sum_to(dp.swapaxes(-1, -2) @ q[..., rows, :], dk.shape[:-2] + (n, dk.shape[-1]))
    d *= scale
    dk[..., cols, :] += d


def _tiles(S, block):
    """(query rows, key cols, diagonal) of the causal tiles of one sequence: key blocks up to the query's."""
    for a in range(0, S, block):
        for c in range(0, a + 1, block):
            yield slice(a, min(S, a + block)), slice(c, min(S, c + block)), c == a


@half.in_fp32
def online_attention_forward(q, k, v, drop_mask=None, drop_scale=1.0, block: int | None = None):
    """attention_forward's result by the online softmax over tiles of block x block (default QUERY_BLOCK):
    no (S, S) array is held, at most one tile of scores; the cache keeps out and lse (B, H, S) instead of
    the probabilities. drop_mask as attention_forward's (each tile takes its part)."""
    xp = array_module(q)
    block = QUERY_BLOCK if block is None else block
    S = q.shape[-2]
    lead = _lead(q, k)
    qs = q * (1.0 / math.sqrt(q.shape[-1]))
    m = xp.full(lead + (S,), -math.inf, dtype=q.dtype)
    l, o = xp.zeros(lead + (S,), dtype=q.dtype), xp.zeros(lead + q.shape[-2:], dtype=q.dtype)
    for rows, cols, diag in _tiles(S, block):
        online_block(qs, k, v, rows, cols, diag, m, l, o,
                     None if drop_mask is None else drop_mask[..., rows, cols], float(drop_scale))
    o /= l[..., None]
    return o, (q, k, v, o, m + xp.log(l), drop_mask, float(drop_scale), block)


@half.backward_of(online_attention_forward)
def online_attention_backward(dout, cache):
    """dq, dk, dv of online_attention_forward, tile by tile, the probabilities recomputed from lse."""
    q, k, v, out, lse, drop_mask, drop_scale, block = cache
    xp = array_module(dout)
    qs = q * (1.0 / math.sqrt(q.shape[-1]))
    delta = xp.einsum("...td,...td->...t", dout, out)                   # rowsum(dout * out)
    dq, dk, dv = (xp.zeros(a.shape, dtype=q.dtype) for a in (q, k, v))
    for rows, cols, diag in _tiles(q.shape[-2], block):
        online_block_backward(qs, q, k, v, rows, cols, diag, lse, delta, dout, dq, dk, dv,
                              None if drop_mask is None else drop_mask[..., rows, cols], drop_scale)
    return dq, dk, dv
