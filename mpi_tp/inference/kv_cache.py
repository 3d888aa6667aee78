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
    """Keys and values of this rank's heads, every block of `model`, `slots` rows, block_size columns."""

    def __init__(self, model, slots: int):
        xp, cfg = backend.xp(), model.cfg
        attn = model.h[0].attn
        shape = (slots, attn.H_kv_i, cfg.block_size, attn.hs)
        self.k = [xp.zeros(shape, dtype=model.dtype) for _ in model.h]
        self.v = [xp.zeros(shape, dtype=model.dtype) for _ in model.h]
        self.slots, self.size, self.dtype = slots, cfg.block_size, model.dtype
        self.compute = xp.float32 if is_half(model.dtype) else model.dtype     # the scores' and softmax's dtype
        self.lengths = numpy.zeros(slots, dtype=numpy.int64)     # columns filled, per row
        self.rows = 0                                             # running rows: 0 .. rows - 1

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    @staticmethod
    def bytes_for(model, slots: int) -> int:
        """What KVCache(model, slots) holds on this rank, without making it: 2 L slots H_kv_i S hs values of
        the model's dtype (2 bytes each at bf16 and fp16)."""
        attn = model.h[0].attn if model.h else None
        per = 0 if attn is None else slots * attn.H_kv_i * model.cfg.block_size * attn.hs
        return 2 * len(model.h) * per * model.dtype.itemsize

    def move(self, src: int, dst: int) -> None:
        """Row src's filled columns into row dst (a finished row's slot reused)."""
        n = int(self.lengths[src])
        for k, v in zip(self.k, self.v):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        self.lengths[dst] = n

    def step_mask(self, at):
        """Where a decode step over rows 0 .. rows - 1 writes and looks, each row at column lengths[b]:
        (n, bias, index) with n = the longest row + 1; bias (rows, 1, 1, n), -inf past each row's new
        column (in the scores' dtype: fp32 for a 16-bit cache), and index (rows, columns) on the device for
        the writes; both None when all rows are level. at: lengths[:rows] already on the device. Made once
        per step, reused by every block."""
        cols = self.lengths[:self.rows]
        n = int(cols.max()) + 1
        if n > self.size:
            raise ValueError(f"the cache holds {self.size} positions: column {n - 1} does not fit")
        if cols.min() == cols.max():
            return n, None, None
        xp = backend.xp()
        bias = xp.where(xp.arange(n)[None, :] <= at[:, None], 0.0, -math.inf).astype(self.compute)
        return n, bias[:, None, None, :], (xp.arange(self.rows), at)


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


def attend_prefill(attn, x, cache: KVCache, j: int, rows, angles=None):
    """Block j's attention (a model.attention.ParallelAttention) for rows starting empty: x (J, t, C),
    their positions 0 .. t - 1 (right-padded), `rows` the J cache rows (a slice, or host indices). Their
    keys and values go into the cache; the queries attend causally to their own: (J, t, C), every rank."""
    q, k, v = attn.project_qkv(x, angles)      # (J, H_i, t, hs), (J, H_kv_i, t, hs) x 2; angles: Rope.prefill_angles
    t = x.shape[1]
    if t > cache.size:
        raise ValueError(f"the cache holds {cache.size} positions: {t} do not fit")
    cache.k[j][rows, :, :t] = k
    cache.v[j][rows, :, :t] = v
    y, _ = attention_forward(*attn.grouped(q, k, v))                 # the training kernel: causal, (J, H_i, t, hs)
    return _project(attn, y)


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
    q, k, v = attn.grouped(q, cache.k[j][:A, :, :n], cache.v[j][:A, :, :n])
    if bias is not None and q.ndim == 5:
        bias = bias[:, None]                                                # (rows, 1, 1, 1, n): grouped
    y, _ = step_attention(q, k, v, bias)                             # (A, H_i, 1, hs) or (A, H_kv_i, R_i, 1, hs)
    return _project(attn, y)
