"""Attention by the online softmax, tile by tile: no (S, S) array is held, neither the probabilities nor, with
dropout, their masks (the caller draws each tile's mask when the tile is computed, and again in the backward).

Legend (docs/notation.md): B = batch, H = heads, S = sequence, hs = head size; Q = the tile's side
(kernels_attention.QUERY_BLOCK); t a query's position, s a key's, S_w the sliding window (attention_span).

    tiles of Q x Q, the keys a strip of queries sees (up to the diagonal; with S_w, from its window's first key):

        each tile's scores merged into each row's running max m, sum l and output o (online_block),
        out = o / l; kept for the backward: out and lse = m + log l (B, H, S), not the probabilities;
        the backward recomputes each tile's p = e^(s - lse) (online_block_backward)

(Milakov and Gimelshein 2018; FlashAttention's merge.) The model runs it from kernels_attention.ONLINE_FROM
positions: at S = 4096 the blocked form keeps 64 MiB of probabilities per head and sequence, the online one
16 KiB of lse; it computes the scores twice (tests/test_online_attention.py). Ring attention
(mpi_tp.parallel.ring_attention) runs the same two block functions over the blocks that travel around the
context-parallel ring.

Dropout: mask_of(rows, cols) gives the bool mask of one tile (mpi_tp.model.dropout.TileMasks draws it from
the Philox counters by the tile's positions, the serial model's bits), so the masks cost one tile at a
time, like the scores, and the backward draws the same bits again.
"""
from __future__ import annotations

import math

from mpi_tp.core import attention_span as span
from mpi_tp.core import kernels_half as half
from mpi_tp.core.backend import array_module
from mpi_tp.core.kernels_attention import QUERY_BLOCK, _lead, _shifted_exp, _softmax_backward, _sum_to


def online_block(qs, k, v, rows, cols, bias, m, l, o, mask=None, drop_scale=1.0):
    """One block of the online softmax: the scores of the queries `rows` (qs: q already scaled) against the
    keys `cols`, merged into the running maximum m, sum l and output o of those rows, in place:

        m' = max(m, max_j s_j)      l' = l e^(m - m') + sum_j e^(s_j - m')      o' = o e^(m - m') + e^(s - m') v

    bias: the tile's additive mask (attention_span.tile_bias; None: every key seen). A row may see none of a
    tile's keys (a window's edge, a ring's block): its terms are then 0, not e^(-inf + inf). mask: the
    block's bool dropout mask, the kept probabilities times drop_scale enter o (not l). At the end out = o / l,
    lse = m + log l."""
    xp = array_module(qs)
    s = qs[..., rows, :] @ k[..., cols, :].swapaxes(-1, -2)
    if bias is not None:
        s += bias
    m_new = xp.maximum(m[..., rows], s.max(axis=-1))
    # a row that has seen no key yet shifts by 0, so its hidden scores give e^(-inf) = 0, not e^(-inf + inf)
    shift = m_new if bias is None else xp.where(m_new == -math.inf, 0, m_new)
    p = _shifted_exp(s, shift[..., None])
    corr = xp.exp(m[..., rows] - shift)
    l[..., rows] = l[..., rows] * corr + p.sum(axis=-1)
    if mask is not None:
        p *= mask
        p *= drop_scale
    o[..., rows, :] = o[..., rows, :] * corr[..., None] + p @ v[..., cols, :]
    m[..., rows] = m_new


def online_block_backward(qs, q, k, v, rows, cols, bias, lse, delta, dout, dq, dk, dv, mask=None, drop_scale=1.0):
    """One block's share of the gradients (FlashAttention's backward): p = e^(s - lse) again from q and k,
    dp = dout v^T, ds = p (dp - delta) with delta = rowsum(dout * out); dq[rows] += ds k scale, dk[cols] += ds^T q
    scale, dv[cols] += p_kept^T dout, summed over broadcast (grouped-query) axes to dk's and dv's shapes."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = qs[..., rows, :] @ k[..., cols, :].swapaxes(-1, -2)
    if bias is not None:
        s += bias
    p = _shifted_exp(s, lse[..., rows, None])
    g = dout[..., rows, :]
    dp = g @ v[..., cols, :].swapaxes(-1, -2)
    kept = p
    if mask is not None:
        kept = p * mask                                                  # one temporary of the tile's size
        kept *= drop_scale
        dp *= mask
        dp *= drop_scale
    n = cols.stop - cols.start
    dv[..., cols, :] += _sum_to(kept.swapaxes(-1, -2) @ g, dv.shape[:-2] + (n, dv.shape[-1]))
    dp = _softmax_backward(dp, delta[..., rows, None], p)                # ds
    dq[..., rows, :] += (dp @ k[..., cols, :]) * scale
    d = _sum_to(dp.swapaxes(-1, -2) @ q[..., rows, :], dk.shape[:-2] + (n, dk.shape[-1]))
    d *= scale
    dk[..., cols, :] += d


def strip_keys(a: int, b: int, window: int | None, block: int | None = None) -> tuple[int, int]:
    """[lo, b): the keys of the tiles that the strip of query rows [a, b) computes, from the start of the tile
    that holds its first seen key (attention_span) to the diagonal."""
    block = QUERY_BLOCK if block is None else block
    lo, _ = span.key_span(a, b - a, window)
    return lo - lo % block, b


def _tiles(S: int, block: int, window: int | None, dtype, xp):
    """(query rows, key cols, bias) of the tiles one sequence computes: for each strip of query rows, the key
    tiles from its first seen key's to the diagonal's (attention_span)."""
    for a in range(0, S, block):
        b = min(S, a + block)
        for c in range(strip_keys(a, b, window, block)[0], a + 1, block):
            d = min(S, c + block)
            yield slice(a, b), slice(c, d), span.tile_bias(a, b - a, c, d - c, window, dtype, xp)


@half.in_fp32
def online_attention_forward(q, k, v, mask_of=None, drop_scale=1.0, block: int | None = None,
                             window: int | None = None):
    """kernels_attention.attention_forward's result by the online softmax over tiles of block x block (default
    QUERY_BLOCK): no (S, S) array is held, at most one tile of scores (and of dropout mask: mask_of(rows, cols),
    the tile's bool mask, or None for no dropout); the cache keeps out and lse (B, H, S) instead of the
    probabilities. window: as attention_forward's."""
    xp = array_module(q)
    block = QUERY_BLOCK if block is None else block
    S = q.shape[-2]
    lead = _lead(q, k)
    qs = q * (1.0 / math.sqrt(q.shape[-1]))
    m = xp.full(lead + (S,), -math.inf, dtype=q.dtype)
    l, o = xp.zeros(lead + (S,), dtype=q.dtype), xp.zeros(lead + q.shape[-2:], dtype=q.dtype)
    for rows, cols, bias in _tiles(S, block, window, q.dtype, xp):
        online_block(qs, k, v, rows, cols, bias, m, l, o, None if mask_of is None else mask_of(rows, cols),
                     float(drop_scale))
    o /= l[..., None]
    return o, (q, k, v, o, m + xp.log(l), mask_of, float(drop_scale), block, window)


@half.backward_of(online_attention_forward)
def online_attention_backward(dout, cache):
    """dq, dk, dv of online_attention_forward, tile by tile, the probabilities (and masks) drawn again."""
    q, k, v, out, lse, mask_of, drop_scale, block, window = cache
    xp = array_module(dout)
    qs = q * (1.0 / math.sqrt(q.shape[-1]))
    delta = xp.einsum("...td,...td->...t", dout, out)                   # rowsum(dout * out)
    dq, dk, dv = (xp.zeros(a.shape, dtype=q.dtype) for a in (q, k, v))
    for rows, cols, bias in _tiles(q.shape[-2], block, window, q.dtype, xp):
        online_block_backward(qs, q, k, v, rows, cols, bias, lse, delta, dout, dq, dk, dv,
                              None if mask_of is None else mask_of(rows, cols), drop_scale)
    return dq, dk, dv
