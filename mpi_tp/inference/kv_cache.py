"""The attention cache of tensor-parallel decoding: each rank keeps the keys and values of its own heads.

    cache = KVCache(model, slots=4)          # (slots, H_kv_i, S_c, hs) keys and values per block, S_c = min(S_w, S)
    y = attend_prefill(block.attn, x, cache, j, rows, angles, keep)   # t new positions of some rows, from position 0
    y = attend_step(block.attn, x, cache, j, mask, angles)     # one new position of every running row

Rank i holds H_kv_i of the H_kv key/value heads (H_kv = H, the query heads, but for
grouped-query attention; uneven splits included; mpi_tp.model.heads), so its
cache is 2 x L x slots x H_kv_i x S_c x hs values, allocated once for S_c = S = block_size
positions (S_c = min(S_w, S) with a sliding window, below): H_kv_i / H_kv of the whole,
and with grouped-query attention H_kv / H of a multi-head model's (when
H_kv < T each rank keeps the one key/value head its query heads read, a
replica of the other holders'). Llama's keys are kept
rotated to their positions (mpi_tp.model.rope): a query rotated to its own
position then attends to them as in the training forward. A row is one sequence; rows 0 .. cache.rows - 1 are
running, each with its own length (`lengths[b]`: its columns 0 .. lengths[b] - 1
hold its tokens, from position 0), so sequences join and leave independently
(continuous batching): a new row is prefilled into a free slot from column 0,
a finished row's slot is taken by the last running row (`move`, only its
filled columns), and a decode step writes each row's new key and value at its
own column. A step's mask is the columns past each row's length: an additive
bias (rows, 1, 1, n) made on the device once per step and reused by every block
(none when every row has the same length: `step_mask`). A prefill is causal attention over
its own t positions (the rows start empty), right-padded to the longest: a
query never sees the padding after it, and the padding columns are past the
row's length, so no later step sees them either.

A sliding window (GPTConfig.sliding_window S_w, Mistral: a query at position t
sees the keys of t - S_w < s <= t) needs only a row's last S_w keys and values:
the cache has S_c = min(S_w, S) columns, a ring per row, position p at column
p mod S_c. A row of length n holds positions max(0, n - S_c) .. n - 1 (its
columns 0 .. n - 1 while n <= S_c; all S_c after); `lengths[b]` counts positions,
not columns. A step writes position n at column n mod S_c, over the oldest, and
attends to the row's filled columns (the mask: columns past n for a row still
shorter than S_c; none once a row has filled its ring); the order of the keys
in the ring does not matter to the softmax. A prefill of t > S_c positions runs
the training kernel with the window (causal and windowed over the prompt) and
keeps each row's last S_c keys and values, each at its ring column
(`prefill_columns`: rows right-padded to different lengths keep different
positions). Positions still stop at block_size (the rotations need no table,
but the decoder's refill past block_size, mpi_tp.inference.decode, is kept).

Per block and new position the communication is that of the forward pass: the
q/k/v column split needs none, the output projection's row split one
all-reduce of (rows, t, C); the cache itself is never communicated.

16-bit models (bf16, fp16: mpi-tp generate --precision): the cache stores the
16-bit keys and values (half an fp32 cache's bytes) and the attention is the
training forward's arithmetic: a prefill runs the training kernel itself
(kernels_attention.attention_forward), a step its one-query form
(`step_attention`); both widen q, k and v to fp32 (exact), compute the scores,
the softmax and the product with v in fp32 and round the output once to the
16-bit format (kernels_half.in_fp32). The linear layers around them are the
model's own (16-bit kernels: fp32 accumulation, one rounding).
"""
from __future__ import annotations

import math

import numpy

from mpi_tp.core import backend
from mpi_tp.core import kernels_half as half
from mpi_tp.core.kernels_attention import attention_forward, softmax_rows
from mpi_tp.core.precision import is_half


class KVCache:
    """Keys and values of this rank's heads, every block of `model`, `slots` rows of S_c columns: S_c = block_size,
    or the model's sliding window S_w if shorter (a ring: position p at column p mod S_c)."""

    def __init__(self, model, slots: int):
        xp, cfg = backend.xp(), model.cfg
        attn = model.h[0].attn
        self.columns = KVCache.columns_for(cfg)                  # S_c
        shape = (slots, attn.H_kv_i, self.columns, attn.hs)
        self.k = [xp.zeros(shape, dtype=model.dtype) for _ in model.h]
        self.v = [xp.zeros(shape, dtype=model.dtype) for _ in model.h]
        self.slots, self.size, self.dtype = slots, cfg.block_size, model.dtype   # size: the positions, S
        self.compute = xp.float32 if is_half(model.dtype) else model.dtype     # the scores' and softmax's dtype
        self.lengths = numpy.zeros(slots, dtype=numpy.int64)     # positions filled, per row
        self.rows = 0                                             # running rows: 0 .. rows - 1

    @staticmethod
    def columns_for(cfg) -> int:
        """S_c, a row's columns: block_size, or the sliding window if shorter."""
        window = cfg.sliding_window
        return cfg.block_size if window is None else min(window, cfg.block_size)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    @staticmethod
    def bytes_for(model, slots: int) -> int:
        """What KVCache(model, slots) holds on this rank, without making it: 2 L slots H_kv_i S_c hs values of
        the model's dtype (2 bytes each at bf16 and fp16), S_c = min(S_w, S) (columns_for)."""
        attn = model.h[0].attn if model.h else None
        per = 0 if attn is None else slots * attn.H_kv_i * KVCache.columns_for(model.cfg) * attn.hs
        return 2 * len(model.h) * per * model.dtype.itemsize

    def move(self, src: int, dst: int) -> None:
        """Row src's filled columns into row dst (a finished row's slot reused)."""
        n = min(int(self.lengths[src]), self.columns)
        for k, v in zip(self.k, self.v):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        self.lengths[dst] = self.lengths[src]

    def prefill_columns(self, lengths, t: int):
        """Which of a prefill's t positions each row keeps: None when they all fit (t <= S_c: position p at
        column p), else (J, 1, S_c, 1) on the device, column c of row b holding the latest of its positions
        p < lengths[b] with p mod S_c = c (position 0 for a column a short row does not reach: masked)."""
        S_c = self.columns
        if t <= S_c:
            return None
        last = numpy.asarray(lengths, dtype=numpy.int64)[:, None] - 1            # (J, 1)
        p = last - (last - numpy.arange(S_c)) % S_c                                   # (J, S_c), p <= last
        return backend.asarray(numpy.maximum(p, 0)[:, None, :, None])

    def step_mask(self, at):
        """Where a decode step over rows 0 .. rows - 1 writes and looks, row b's new position lengths[b] at
        column lengths[b] mod S_c: (n, bias, index) with n = min(the longest row + 1, S_c) columns to read; bias
        (rows, 1, 1, n), -inf at each row's columns not yet filled (in the scores' dtype: fp32 for a 16-bit
        cache), None when all rows are level; index: the cache's (rows, :, column) to write. at: lengths[:rows]
        already on the device. Made once per step, reused by every block."""
        cols, S_c = self.lengths[:self.rows], self.columns
        if int(cols.max()) + 1 > self.size:
            raise ValueError(f"the cache holds {self.size} positions: position {int(cols.max())} does not fit")
        n = min(int(cols.max()) + 1, S_c)
        if cols.min() == cols.max():
            return n, None, (slice(0, self.rows), slice(None), int(cols[0]) % S_c)
        xp = backend.xp()
        bias = xp.where(xp.arange(n)[None, :] <= at[:, None], 0.0, -math.inf).astype(self.compute)
        return n, bias[:, None, None, :], (xp.arange(self.rows), slice(None), at % S_c)


@half.in_fp32
def step_attention(q, k, v, bias=None):
    """One query per row against its cached columns: softmax(q k^T / sqrt(hs) + bias) v. q (A, H, 1, hs), k and v
    (A, H, n, hs) (grouped: q (A, H_kv, R, 1, hs), k and v (A, H_kv, 1, n, hs)); bias broadcastable to the scores
    (A, H, 1, n), -inf past a row's length, or None. -> (out (A, H, 1, hs), None). 16-bit q, k, v: computed in
    fp32, the output rounded once (kernels_half.in_fp32); the scores scaled as the training kernel scales them."""
    att = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.swapaxes(-1, -2)            # (A, H, 1, n)
    if bias is not None:
        att += bias
    return softmax_rows(att) @ v, None                                          # (A, H, 1, hs)


def _project(attn, y):
    """(B, H_kv_i, R_i, t, hs) or (B, H_i, t, hs) -> the output projection's (B, t, C), all-reduced."""
    y = attn.ungroup(y)
    B, _, t, _ = y.shape
    return attn.proj.forward(y.transpose(0, 2, 1, 3).reshape(B, t, attn.H_i * attn.hs))


def attend_prefill(attn, x, cache: KVCache, j: int, rows, angles=None, keep=None):
    """Block j's attention (a model.attention.ParallelAttention) for rows starting empty: x (J, t, C),
    their positions 0 .. t - 1 (right-padded), `rows` the J cache rows (a slice, or host indices). Their
    keys and values go into the cache (keep: cache.prefill_columns's, for t > S_c); the queries attend causally
    (within the window, if any) to their own: (J, t, C), every rank. angles: Rope.prefill_angles (None: 0 ... t - 1)."""
    q, k, v = attn.project_qkv(x, angles)                            # (J, H_i, t, hs), (J, H_kv_i, t, hs) x 2
    t = x.shape[1]
    if t > cache.size:
        raise ValueError(f"the cache holds {cache.size} positions: {t} do not fit")
    if keep is None:
        cache.k[j][rows, :, :t] = k
        cache.v[j][rows, :, :t] = v
    else:                                                            # each row's last S_c, at their ring columns
        xp, shape = backend.xp(), k.shape[:2] + (cache.columns, k.shape[3])
        cache.k[j][rows] = xp.take_along_axis(k, xp.broadcast_to(keep, shape), axis=2)
        cache.v[j][rows] = xp.take_along_axis(v, xp.broadcast_to(keep, shape), axis=2)
    y, _ = attention_forward(*attn.grouped(q, k, v), window=attn.window)    # the training kernel, (J, H_i, t, hs)
    return _project(attn, y)


def attend_step(attn, x, cache: KVCache, j: int, mask, angles=None):
    """Block j's attention for one new position of every running row: x (rows, 1, C), row b's at
    position lengths[b] (written at its column, lengths[b] mod S_c), attending to its filled columns (those of
    positions lengths[b] - S_c + 1 .. lengths[b]); mask: the step's (KVCache.step_mask); angles: llama's
    rotations to each row's position (Rope.angles), None for GPT-2. -> (rows, 1, C) on every rank."""
    q, k, v = attn.project_qkv(x, angles)                            # (A, H_i, 1, hs), (A, H_kv_i, 1, hs) x 2
    A, (n, bias, index) = x.shape[0], mask
    cache.k[j][index] = k[:, :, 0]                                   # (A, H_kv_i, hs) at each row's column
    cache.v[j][index] = v[:, :, 0]
    q, k, v = attn.grouped(q, cache.k[j][:A, :, :n], cache.v[j][:A, :, :n])
    if bias is not None and q.ndim == 5:
        bias = bias[:, None]                                                # (rows, 1, 1, 1, n): grouped
    y, _ = step_attention(q, k, v, bias)                             # (A, H_i, 1, hs) or (A, H_kv_i, R_i, 1, hs)
    return _project(attn, y)
