"""Ring attention: causal attention over a sequence split by context parallelism (mpi_tp.parallel.context_parallel).

Legend (docs/notation.md): Z = cp ranks, r = this rank, S_r its positions (two chunks), hs head size.
When 2Z divides S every S_r is S / Z; otherwise the ranks' S_r differ by a position or two.

Each rank keeps its queries; the keys and values travel. At step s = 0 ... Z-1 rank r holds the keys
and values of rank r - s (mod Z): it starts sending them on to rank r + 1 and receiving the next
ones from rank r - 1 (Isend / Irecv), then computes the attention of its queries against the block it
holds while the next one is in flight. A query's softmax is over every key it sees, in blocks that
arrive one by one, so each block's scores are merged into a running maximum m, sum l and output o
(the online softmax of Milakov and Gimelshein 2018, FlashAttention's merge; the block's arithmetic is
mpi_tp.core.kernels_online.online_block, which one rank runs alone for long sequences):

    m' = max(m, max_j s_j)      l' = l e^(m - m') + sum_j e^(s_j - m')      o' = o e^(m - m') + e^(s - m') v

and at the end out = o / l, with lse = m + log l kept for the backward pass. Which (query chunk, key
chunk) pairs are computed follows from the chunk order alone: a later key chunk than the query
chunk is skipped, the same chunk is causal (the triangle), an earlier one is whole (with a sliding window,
the pairs wholly outside it are skipped too and its edge masked: mpi_tp.core.attention_span).

Backward (FlashAttention's, block by block): p = e^(s - lse) again from q, k and lse (no (S, S) array
is kept), delta = rowsum(dout * out), ds = p (dp - delta). The keys and values go around the ring once more,
now with their gradients dK and dV beside them: each rank adds its queries' contributions to the
block it holds and passes block and gradients on, and after the Z-th hop the gradients are back with
the rank that owns them. Messages per layer and rank (counted on the group "cp"): forward Z - 1
sends of K and V; backward Z - 1 of K and V and Z of dK and dV. A message at step s carries rank
(r - s) mod Z's block, 2 B H_kv S_(r-s) hs values (2 B H_kv (S/Z) hs when 2Z divides S)
(tests/test_context_parallel.py checks the counts against this closed form). The time a rank spends
blocked in the waits is counted as "cp/ring_wait" (what the overlap did not hide).

16-bit q, k, v (bf16, fp16): the arithmetic in fp32 and the messages in the 16-bit format, as a GPU's
flash attention and ring attention do it. The K/V blocks travel as they are (2 bytes a value); each
block is widened on arrival (exact) and its scores, the running m, l and o and the lse are fp32; the
output is rounded once, at the end. The backward keeps that 16-bit output and the fp32 lse (FlashAttention
2's cache: delta = rowsum(dout * out) from the stored output, in fp32), accumulates dq and each hop's dK, dV in
fp32 and rounds dq once; dK and dV travel in the 16-bit format, so the partial sums are rounded once per
hop: Z roundings of a sum of Z ranks' contributions (within Z u sum_j |c_j|, u the format's unit
roundoff: tests/test_precision_layouts.py), the price of half the bytes on the ring.

Dropout: a block's mask is the part of the serial model's (B, H, S, S) mask at its (query, key)
positions (mpi_tp.model.dropout keys every element by its global position), drawn by the caller.
"""
from __future__ import annotations

import math

from mpi_tp.core.backend import array_module
from mpi_tp.core import attention_span as span
from mpi_tp.core.kernels_attention import _sum_to
from mpi_tp.core.kernels_online import online_block, online_block_backward
from mpi_tp.core.precision import computed, stored

TAG = 31


def blocks(split, src: int, window=None, dtype=None, xp=None, rank: int | None = None):
    """(query rows, key rows, bias) of every computed pair of `rank`'s queries (default this rank's) and rank
    src's keys: the pairs where some query sees some key (mpi_tp.core.attention_span, by their global
    positions), bias None for a pair seen whole (dtype and xp: the bias's; None: the pairs alone)."""
    for qa, qb, gq, _ in split.runs(rank):
        for ka, kb, gk, _ in split.runs(src):
            if span.sees(gq, qb - qa, gk, kb - ka, window):
                bias = None if xp is None else span.tile_bias(gq, qb - qa, gk, kb - ka, window, dtype, xp)
                yield slice(qa, qb), slice(ka, kb), bias


def _pass_on(group, kv, src_next: int, split, xp):
    """Start sending kv to rank r + 1 and receiving rank src_next's block (from r - 1) into a new array."""
    n, r = group.size, group.rank
    nxt = xp.empty(kv.shape[:-2] + (split.length(src_next), kv.shape[-1]), dtype=kv.dtype)
    return nxt, [group.isend(kv, (r + 1) % n, TAG), group.irecv(nxt, (r - 1) % n, TAG)]


def _around(split, kv, xp, after=None):
    """The ring's steps: yields (src, the K/V block of rank src held now); the next block's messages start
    before each step's body and are waited for after it, with the messages after(src) starts then."""
    group = split.group
    n, r = group.size, group.rank
    for s in range(n):
        src = (r - s) % n
        pending = []
        if s < n - 1:
            nxt, pending = _pass_on(group, kv, (src - 1) % n, split, xp)
        yield src, kv
        if after is not None:
            pending += after(src)
        _wait(group, pending)
        if s < n - 1:
            kv = nxt


def _wait(group, pending) -> None:
    """Wait for a step's messages; the time blocked here is counted once, as cp/ring_wait (the sends'
    and receives' own waits inside add none: CommStats.blocked)."""
    if pending:
        key = f"{group.name}/ring_wait"
        with group.stats.blocked(key, trace=True):
            for req in pending:
                req.wait()
        group.stats.count(key)


def ring_forward(q, k, v, split, mask_of=None, drop_scale: float = 1.0, window: int | None = None):
    """Causal attention of this rank's queries over the whole sequence. q (..., S_r, hs), k and v
    (..., S_r, hs) (leading axes broadcast: grouped-query attention). mask_of(src, rows, cols), if
    given, is the bool dropout mask of this rank's query rows against rank src's key rows. window: a
    query sees its `window` latest keys only (the pairs outside it are skipped; every block still travels).
    Returns out (like q) and the cache for ring_backward. 16-bit inputs: see the module docstring."""
    xp, scale = array_module(q), 1.0 / math.sqrt(q.shape[-1])
    qs = computed(q) * scale
    m = xp.full(q.shape[:-1], -math.inf, dtype=qs.dtype)     # the softmax's statistics: fp32 or wider
    l, o = xp.zeros(q.shape[:-1], dtype=qs.dtype), xp.zeros(q.shape, dtype=qs.dtype)
    mine = xp.stack((k, v))                                  # (2, ..., S_r, hs): one message, q's format
    for src, kv in _around(split, mine, xp):
        kv_c = computed(kv)                                  # widened once per block, not per tile
        for rows, cols, bias in blocks(split, src, window, qs.dtype, xp):
            online_block(qs, kv_c[0], kv_c[1], rows, cols, bias, m, l, o,
                         None if mask_of is None else mask_of(src, rows, cols), drop_scale)
    out = stored(o / l[..., None], q.dtype)                 # rounded once (16 bits)
    return out, (q, k, v, out, m + xp.log(l), split, window, mask_of, drop_scale)


def ring_backward(dout, cache):
    """dq, dk, dv (like q, k and v) of ring_forward's output gradient dout."""
    q, k, v, out, lse, split, window, mask_of, drop_scale = cache
    xp, group = array_module(q), split.group
    n, r, scale = group.size, group.rank, 1.0 / math.sqrt(q.shape[-1])
    q_c = computed(q)
    qs, dout_c = q_c * scale, computed(dout)
    delta = xp.einsum("...td,...td->...t", dout_c, computed(out))   # rowsum(dout * out), fp32 for 16 bits
    dq = xp.zeros(q.shape, dtype=q_c.dtype)
    mine = xp.stack((k, v))                                  # (2, ..., S_r, hs): one message
    # dK, dV of the block held, travelling with it in k's format; summed in q_c's (fp32 for 16 bits)
    grads = {"held": xp.zeros(mine.shape, dtype=q_c.dtype)}

    def hand_on(src):                                           # this block's gradients go on with it
        if n == 1:
            return []
        dkv = stored(grads["held"], k.dtype)                   # the message: rounded once per hop
        grads["held"] = xp.empty(dkv.shape[:-2] + (split.length((src - 1) % n), dkv.shape[-1]), dtype=k.dtype)
        return [group.isend(dkv, (r + 1) % n, TAG + 1), group.irecv(grads["held"], (r - 1) % n, TAG + 1)]
    for src, kv in _around(split, mine, xp, hand_on):
        dkv = grads["held"] = computed(grads["held"])
        kv_c = computed(kv)
        for rows, cols, bias in blocks(split, src, window, qs.dtype, xp):
            online_block_backward(qs, q_c, kv_c[0], kv_c[1], rows, cols, bias, lse, delta, dout_c, dq, dkv[0], dkv[1],
                                  None if mask_of is None else mask_of(src, rows, cols), drop_scale)
    dkv = stored(grads["held"], k.dtype)                       # this rank's own, home after the Z-th hop
    return stored(dq, q.dtype), _sum_to(dkv[0], k.shape), _sum_to(dkv[1], v.shape)
