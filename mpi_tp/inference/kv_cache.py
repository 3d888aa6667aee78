"""The attention cache of tensor-parallel decoding: each rank keeps the keys and values of its own heads.

    cache = KVCache(model, slots=4)          # (slots, H_kv_i, block_size, hs) keys and values per block
    y = attend_prefill(block.attn, x, cache, j, rows)          # t new positions of some rows, from column 0
    y = attend_step(block.attn, x, cache, j, mask, angles)     # one new position of every running row

Rank i holds H_kv_i of the H_kv key/value heads (H_kv = H, the query heads, but for
grouped-query attention; uneven splits included; mpi_tp.model.heads), so its
cache is 2 x L x slots x H_kv_i x S x hs values, allocated once for S = block_size
positions: H_kv_i / H_kv of the whole, and with grouped-query attention H_kv / H of a
multi-head model's (when H_kv < T each rank keeps the one key/value head its
query heads read, a replica of the other holders'). Llama's keys are kept
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

Per block and new position the communication is that of the forward pass: the
q/k/v column split needs none, the output projection's row split one
all-reduce of (rows, t, C); the cache itself is never communicated.
"""
from __future__ import annotations

import math

import numpy

from mpi_tp.core import backend
from mpi_tp.core.kernels_attention import softmax_rows


class KVCache:
    """Keys and values of this rank's heads, every block of `model`, `slots` rows, block_size columns."""

    def __init__(self, model, slots: int):
        xp, cfg = backend.xp(), model.cfg
        attn = model.h[0].attn
        shape = (slots, attn.H_kv_i, cfg.block_size, attn.hs)
        self.k = [xp.zeros(shape, dtype=model.dtype) for _ in model.h]
        self.v = [xp.zeros(shape, dtype=model.dtype) for _ in model.h]
        self.slots, self.size, self.dtype = slots, cfg.block_size, model.dtype
        self.lengths = numpy.zeros(slots, dtype=numpy.int64)     # columns filled, per row
        self.rows = 0                                             # running rows: 0 .. rows - 1
        self._causal = {}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    def move(self, src: int, dst: int) -> None:
        """Row src's filled columns into row dst (a finished row's slot reused)."""
        n = int(self.lengths[src])
        for k, v in zip(self.k, self.v):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        self.lengths[dst] = n

    def causal_bias(self, t: int):
        """(t, t): 0 on and below the diagonal, -inf above; made on the device once per t."""
        if t not in self._causal:
            xp = backend.xp()
            i = xp.arange(t)
            self._causal[t] = xp.where(i[None, :] <= i[:, None], 0.0, -math.inf).astype(self.dtype)
        return self._causal[t]

    def step_mask(self, at):
        """Where a decode step over rows 0 .. rows - 1 writes and looks, each row at column lengths[b]:
        (n, bias, index) with n = the longest row + 1; bias (rows, 1, 1, n), -inf past each row's new
        column, and index (rows, columns) on the device for the writes; both None when all rows are
        level. at: lengths[:rows] already on the device. Made once per step, reused by every block."""
        cols = self.lengths[:self.rows]
        n = int(cols.max()) + 1
        if n > self.size:
            raise ValueError(f"the cache holds {self.size} positions: column {n - 1} does not fit")
        if cols.min() == cols.max():
            return n, None, None
        xp = backend.xp()
        bias = xp.where(xp.arange(n)[None, :] <= at[:, None], 0.0, -math.inf).astype(self.dtype)
        return n, bias[:, None, None, :], (xp.arange(self.rows), at)


def _softmax_times_v(att, v):
    """Softmax over the last axis of the masked scores (B, H, t, n) (kernels_attention.softmax_rows: in place on
    the CPU), then times v (B, H, n, hs) (grouped: (B, H_kv, R, t, n) times (B, H_kv, 1, n, hs))."""
    return softmax_rows(att) @ v                                                # (B, H, t, hs)


def _project(attn, y):
    """(B, H_kv_i, R_i, t, hs) or (B, H_i, t, hs) -> the output projection's (B, t, C), all-reduced."""
    y = attn.ungroup(y)
    B, _, t, _ = y.shape
    return attn.proj.forward(y.transpose(0, 2, 1, 3).reshape(B, t, attn.H_i * attn.hs))


def _scores(attn, q, k):
    """q (B, H_i, t, hs) against keys (B, H_kv_i, n, hs): scaled scores (B, H_i, t, n), grouped as
    (B, H_kv_i, R_i, t, n) under grouped-query attention (each key/value head serves R_i query heads)."""
    q, k, _ = attn.grouped(q, k, k)
    return (q * (1.0 / math.sqrt(attn.hs))) @ k.swapaxes(-1, -2)


def _values(attn, v):
    return v if attn.H_kv_i == attn.H_i else v[:, :, None]


def attend_prefill(attn, x, cache: KVCache, j: int, rows):
    """Block j's attention (a model.attention.ParallelAttention) for rows starting empty: x (J, t, C),
    their positions 0 .. t - 1 (right-padded), `rows` the J cache rows (a slice, or host indices). Their
    keys and values go into the cache; the queries attend causally to their own: (J, t, C), every rank."""
    q, k, v = attn.project_qkv(x)                                    # (J, H_i, t, hs), (J, H_kv_i, t, hs) x 2
    t = x.shape[1]
    if t > cache.size:
        raise ValueError(f"the cache holds {cache.size} positions: {t} do not fit")
    cache.k[j][rows, :, :t] = k
    cache.v[j][rows, :, :t] = v
    att = _scores(attn, q, k)                                        # (J, H_i, t, t) or (J, H_kv_i, R_i, t, t)
    att += cache.causal_bias(t)
    return _project(attn, _softmax_times_v(att, _values(attn, v)))


def attend_step(attn, x, cache: KVCache, j: int, mask, angles=None):
    """Block j's attention for one new position of every running row: x (rows, 1, C), row b's at
    column lengths[b] (written there), attending to its columns 0 .. lengths[b]; mask: the step's
    (KVCache.step_mask); angles: llama's rotations to each row's position (Rope.angles), None for GPT-2.
    -> (rows, 1, C) on every rank."""
    q, k, v = attn.project_qkv(x, angles)                            # (A, H_i, 1, hs), (A, H_kv_i, 1, hs) x 2
    A, (n, bias, index) = x.shape[0], mask
    if index is None:                                                       # every row at column n - 1
        cache.k[j][:A, :, n - 1] = k[:, :, 0]
        cache.v[j][:A, :, n - 1] = v[:, :, 0]
    else:
        cache.k[j][index[0], :, index[1]] = k[:, :, 0]
        cache.v[j][index[0], :, index[1]] = v[:, :, 0]
    att = _scores(attn, q, cache.k[j][:A, :, :n])                    # (A, H_i, 1, n) or (A, H_kv_i, R_i, 1, n)
    if bias is not None:
        att += bias if att.ndim == 4 else bias[:, None]                     # (rows, 1, 1, n) (, 1)
    return _project(attn, _softmax_times_v(att, _values(attn, cache.v[j][:A, :, :n])))
