"""The attention cache of tensor-parallel decoding: each rank keeps the keys and values of its own heads.

    cache = KVCache(model, batch=4)          # (B, H_i, block_size, hs) keys and values per block
    y = attend(block.attn, x, cache, j)      # t new positions of every row, over the cache

Rank i holds H_i of the H heads (uneven splits included), so its cache is
H_i / H of the whole: 2 x L x B x H_i x S x hs values, allocated once for
S = block_size positions. The rows of a batch share the cache's columns:
prompts of different lengths are left-padded, and `first[b]` is the first
column of row b that holds a token. A query at column c attends to the keys
of its row at columns first[b] .. c; a padding query (c < first[b]) attends to
itself only, so that it stays finite and touches no real row. A decode step
(one new column per row, past every row's padding) needs only the padding
columns masked: step_attention adds KVCache.padding, a bias built once per
prefill. A prefill adds KVCache.prefill_bias, that rule as a bias built once
per forward on the device from `first` (uploaded once per prefill), which
every block reuses: no host traffic per block.

Per block and new position the communication is that of the forward pass: the
q/k/v column split needs none, the output projection's row split one
all-reduce of (B, t, C); the cache itself is never communicated.
"""
from __future__ import annotations

import math

import numpy

from mpi_tp.core import backend
from mpi_tp.core.backend import array_module


class KVCache:
    """Keys and values of this rank's heads, every block of `model`, `batch` rows, block_size columns."""

    def __init__(self, model, batch: int):
        xp, cfg = backend.xp(), model.cfg
        attn = model.h[0].attn
        shape = (batch, attn.H_i, cfg.block_size, attn.hs)
        self.k = [xp.zeros(shape, dtype=model.dtype) for _ in model.h]
        self.v = [xp.zeros(shape, dtype=model.dtype) for _ in model.h]
        self.batch, self.size, self.dtype = batch, cfg.block_size, model.dtype
        self.reset(numpy.zeros(batch, dtype=numpy.int64))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    def reset(self, first) -> None:
        """Start again: empty, with row b's tokens from column first[b]. A decode step's mask is
        only these padding columns: kept as an additive bias (B, 1, 1, S), -inf before first[b]
        (None when no row is padded), so that a step builds no mask."""
        self.length = 0                                # columns filled (the same for every row)
        self.first = numpy.asarray(first, dtype=numpy.int64)
        self.first_on_device = backend.asarray(self.first)   # host -> device: B int64, once per prefill
        self._bias, self._bias_for = None, None
        self.real_from = int(self.first.max(initial=0))   # from this column on, no row holds padding
        self.padding = None
        if self.first.any():
            bias = numpy.where(numpy.arange(self.size) < self.first[:, None], -math.inf, 0.0)
            self.padding = backend.asarray(bias[:, None, None, :].astype(self.dtype))

    def prefill_bias(self, start: int, t: int):
        """The mask of t new columns at `start` as an additive bias (B, 1, t, start + t): 0 where the
        query may look (keys of its row from first[b] up to itself; a padding query, itself only),
        -inf elsewhere. Made on the device once per forward and reused by every block."""
        if self._bias_for != (start, t):
            xp, n = backend.xp(), start + t
            cols = xp.arange(n)[None, None, :]
            rows = (start + xp.arange(t))[None, :, None]
            first = self.first_on_device[:, None, None]
            allowed = ((cols <= rows) & (cols >= first)) | (cols == rows)       # (B, t, n)
            bias = xp.where(allowed, 0.0, -math.inf).astype(self.dtype)
            self._bias, self._bias_for = bias[:, None], (start, t)
        return self._bias


def cached_attention(q, k, v, start: int, bias):
    """softmax(q k^T / sqrt(hs)) v over the cache. q (B, H, t, hs): the queries of columns start ..
    start + t - 1; k, v (B, H, S, hs) with columns 0 .. start + t - 1 filled; bias (B, 1, t, n): the
    mask, KVCache.prefill_bias(start, t). -> (B, H, t, hs). The same arithmetic as
    kernels.attention_forward (adding 0 changes no score; adding -inf is masking)."""
    t, hs = q.shape[-2:]
    n = start + t
    att = (q * (1.0 / math.sqrt(hs))) @ k[:, :, :n].swapaxes(-1, -2)         # (B, H, t, n)
    att += bias
    return _softmax_times_v(att, v, n)


def step_attention(q, k, v, n: int, padding=None):
    """cached_attention for one query column per row, at column n - 1, after every row's padding
    (a decode step): it sees every filled column of its row, so the mask is the padding bias alone
    (KVCache.padding, (B, 1, 1, S), or None: no padding). q (B, H, 1, hs) -> (B, H, 1, hs)."""
    att = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k[:, :, :n].swapaxes(-1, -2)  # (B, H, 1, n)
    if padding is not None:
        att += padding[..., :n]
    return _softmax_times_v(att, v, n)


def _softmax_times_v(att, v, n: int):
    """Softmax over the last axis of the masked scores (B, H, t, n), in place, then times v[:, :, :n]."""
    xp = array_module(att)
    att -= att.max(axis=-1, keepdims=True)
    xp.exp(att, out=att)
    att *= 1.0 / (att @ xp.ones(n, dtype=att.dtype))[..., None]             # row sums by BLAS
    return att @ v[:, :, :n]                                                # (B, H, t, hs)


def attend(attn, x, cache: KVCache, j: int):
    """Block j's attention (a model.attention.ParallelAttention) for the t new columns x (B, t, C)
    at cache.length: their keys and values go into the cache, the queries read all of it; the
    output projection's all-reduce makes the result whole: (B, t, C) on every rank."""
    B, t = x.shape[:2]
    start = cache.length
    if start + t > cache.size:
        raise ValueError(f"the cache holds {cache.size} positions: {start} + {t} do not fit")
    qkv = attn.qkv.forward(x).reshape(B, t, 3, attn.H_i, attn.hs)
    q, k, v = qkv.transpose(2, 0, 3, 1, 4)                                  # each (B, H_i, t, hs)
    cache.k[j][:, :, start:start + t] = k
    cache.v[j][:, :, start:start + t] = v
    if t == 1 and start >= cache.real_from:                                 # a decode step
        y = step_attention(q, cache.k[j], cache.v[j], start + 1, cache.padding)
    else:
        y = cached_attention(q, cache.k[j], cache.v[j], start, cache.prefill_bias(start, t))
    return attn.proj.forward(y.transpose(0, 2, 1, 3).reshape(B, t, attn.H_i * attn.hs))
