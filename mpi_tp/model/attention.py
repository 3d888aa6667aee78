"""Causal self-attention split by heads: q/k/v column-parallel, the output projection row-parallel.

Legend (docs/notation.md): B = batch, S = sequence, C = channels, hs = head size, H query heads, H_kv
key/value heads, R = H/H_kv; rank i holds H_i query heads and the H_kv_i key/value heads they read
(mpi_tp.model.heads), R_i = H_i / H_kv_i of its query heads per key/value head.

    q, k, v = x W_q, x W_k, x W_v       QKVParallelLinear: f, one GEMM (GPT-2: + biases)
    q, k = rope(q), rope(k)             llama: rotary positions 0 ... S-1, per head (mpi_tp.model.rope)
    y = softmax(q k^T / sqrt(hs)) v     causal, per query head; with H_kv < H each key/value head serves
                                        its R_i query heads (a broadcast, no copies)
    out = y W_o                         row-parallel, g (GPT-2: + bias, added once after the reduce)

Under context parallelism (cp) each rank holds its two chunks of the sequence, S_r positions: q, k
and v are computed for those, rotated to their global positions, and the softmax runs as ring
attention over the cp group (mpi_tp.parallel.ring_attention), keeping no (S, S) array. Without cp, a
sequence of ONLINE_FROM positions or more runs the same online softmax on one rank, tile by tile
(mpi_tp.core.kernels_online.online_attention_forward): the cache keeps the output and the rows'
log-sum-exp instead of the probabilities (selective recomputation has nothing left to drop there).
Both draw the dropout masks by tile (mpi_tp.model.dropout.TileMasks: a strip of query rows at a time
on one rank, a chunk pair at a time on the ring), in the forward and again in the backward: no
(S, S) mask either. A sliding window (cfg.sliding_window, S_w) limits each query to its S_w latest keys
in every form (mpi_tp.core.attention_span); the tiles and ring pairs outside it are not computed.
"""
from __future__ import annotations

import math

from mpi_tp.core import backend
from mpi_tp.core import kernels as kern
from mpi_tp.core import kernels_attention as ka
from mpi_tp.core import kernels_online as ko
from mpi_tp.core.module import Module
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.dropout import TileMasks
from mpi_tp.model.forward_pass import NO_PASS, Pass
from mpi_tp.model.heads import head_layout
from mpi_tp.model.parallel_linear import RowParallelLinear
from mpi_tp.model.qkv import QKVParallelLinear
from mpi_tp.model.rope import PassAngles, Rope, rope_table
from mpi_tp.parallel.ring_attention import ring_backward, ring_forward
from mpi_tp.parallel.topology import Topology


class ParallelAttention(Module):
    """Causal self-attention with the heads divided among the tensor-parallel ranks.

    recompute (set by the model for --recompute selective): keep only q, k and v for
    the backward pass and compute the softmax probabilities (and their dropout) again
    there (Korthikanti et al. 2022's selective recomputation: the H S^2 B / T term).
    """

    recompute = False

    def __init__(self, name, cfg: GPTConfig, topo: Topology, dtype, seed, layer: int, sp: bool = False):
        """sp: sequence parallelism on (the output projection's bias then sees this rank's positions only)."""
        tp = topo.tp
        self.group, self.layer = tp, layer
        C, H = cfg.n_embd, cfg.n_head
        self.hs = C // H
        self.layout = head_layout(H, cfg.kv_heads, tp.size)
        self.heads, self.kv_heads = self.layout.q[tp.rank], self.layout.kv[tp.rank]
        self.H_i, self.H_kv_i = len(self.heads), len(self.kv_heads)
        bias = not cfg.llama
        self.qkv = QKVParallelLinear(name, C, self.hs, self.layout, topo, dtype, bias=bias or cfg.qkv_bias, seed=seed)
        self.rope = Rope(self.hs, cfg.rope_theta, dtype, cfg.rope_scaling) if cfg.llama else None
        self.window = cfg.sliding_window                   # S_w: a query sees its S_w latest keys (None: all earlier)
        cols = [len(q) * self.hs for q in self.layout.q]   # the output projection's rows follow the query heads
        self.proj = RowParallelLinear(f"{name}/proj", C, C, tp, dtype, sizes=cols, seed=seed, bias=bias,
                                      std=0.02 / math.sqrt(2 * cfg.n_layer), sp=sp)

    def project_qkv(self, x, angles=None, sp=None):
        """x -> q (B, H_i, S, hs), k and v (B, H_kv_i, S, hs), head-major and contiguous; llama: q and k rotated
        to positions 0 ... S-1, or by `angles` (Rope.angles: one position per row, for cached decoding).
        sp: the pass's SequenceSplit (x is then this rank's positions, gathered first)."""
        q, k, v = self.qkv.forward(x, sp)                                # (B, S, H_i, hs), (B, S, H_kv_i, hs) x 2
        xp = backend.xp()
        # one copy into head-major order, so that the batched attention products see contiguous heads
        q, k, v = (xp.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v))
        if self.rope is not None:
            q, k = self.rope.forward(q, k, angles)
        return q, k, v

    def grouped(self, q, k, v):
        """Grouped-query attention as a broadcast: q (B, H_kv_i, R_i, S, hs), k and v (B, H_kv_i, 1, S, hs);
        plain multi-head attention (H_kv_i = H_i) is left as it is."""
        if self.H_kv_i == self.H_i:
            return q, k, v
        B, _, S, hs = q.shape
        return q.reshape(B, self.H_kv_i, self.H_i // self.H_kv_i, S, hs), k[:, :, None], v[:, :, None]

    def ungroup(self, y):
        """(B, H_kv_i, R_i, S, hs) or (B, H_i, S, hs) -> (B, H_i, S, hs)."""
        return y.reshape(y.shape[0], self.H_i, *y.shape[-2:])

    def forward(self, x, ps: Pass = NO_PASS):
        """x (B, S, C), or this rank's positions of the micro-batch's pass ps (its sp and cp cuts; its
        masks draw the attention probabilities' dropout) -> the same shape."""
        if ps.cp is not None:
            return self._ring_forward(x, ps)
        q, k, v = self.project_qkv(x, sp=ps.sp)                          # S: the whole sequence, also under sp
        B, _, S, _ = q.shape
        gq, gk, gv = self.grouped(q, k, v)
        if S >= ka.ONLINE_FROM:      # long sequences: the online softmax, no (S, S) array kept, masks by tile
            y, cache = ko.online_attention_forward(gq, gk, gv, self._tile_masks(B, ps, S), ps.scale,
                                                   window=self.window)
            self.save_cache(cache, "online")
        else:
            mask = (ps.masks.head_masks(B, S, self.heads, self.layer)    # bool (B, H_i, S, S): this
                    if ps.masks is not None else None)                   # rank's heads only
            y, cache = kern.attention_forward(gq, gk, gv, self._grouped_mask(mask), ps.scale, window=self.window)
            if self.recompute:       # selective recomputation: keep q, k, v, not the (B, H_i, S, S) arrays
                cache = (gq, gk, gv, ps.masks)
            self.save_cache(cache, "dense")
        y = self.ungroup(y).transpose(0, 2, 1, 3).reshape(B, S, self.H_i * self.hs)   # (B, S, H_i hs)
        return self.proj.forward(y, ps.sp)                               # row split + g -> (B, S, C)
                                                                         # (sp: reduce-scatter -> (B, S_i, C))

    def _ring_forward(self, x, ps: Pass):
        """Context parallelism: this rank's positions' q, k, v (rotated to their global positions), the
        softmax over every rank's keys by ring attention."""
        angles, cp = None, ps.cp
        if self.rope is not None:                        # made once per pass, shared by every block
            key = ("rope", self.hs, self.rope.theta, str(self.rope.dtype), repr(self.rope.scaling))
            if key not in cp.shared:
                cos, sin = rope_table(cp.S, self.hs, self.rope.theta, self.rope.dtype, self.rope.scaling)
                at = backend.asarray(cp.positions)
                cp.shared[key] = PassAngles(cos[at], sin[at])
            angles = cp.shared[key]
        q, k, v = self.project_qkv(x, angles, ps.sp)                     # (B, heads, S_r, hs)
        B, _, S, _ = q.shape
        gq, gk, gv = self.grouped(q, k, v)
        y, cache = ring_forward(gq, gk, gv, cp, self._ring_masks(B, ps), ps.scale, self.window)
        self.save_cache(cache[:7] + (ps,), "ring")                       # the masks are drawn again
        y = self.ungroup(y).transpose(0, 2, 1, 3).reshape(B, S, self.H_i * self.hs)
        return self.proj.forward(y, ps.sp)

    def _tile_masks(self, B, ps: Pass, S):
        """mask_of(rows, cols) for the online softmax: the tile's dropout masks, a strip of query rows drawn
        at a time (TileMasks); None without dropout."""
        if ps.masks is None:
            return None
        tiles = TileMasks(ps.masks, B, S, self.heads, self.layer, lambda t, n: ko.strip_keys(t, t + n, self.window))
        return lambda rows, cols: self._grouped_mask(tiles(rows, cols))

    def _ring_masks(self, B, ps: Pass):
        """mask_of(src, rows, cols) for ring attention: the serial model's masks at this rank's query rows and
        rank src's key rows, each pair drawn by itself (TileMasks); None without dropout."""
        if ps.masks is None:
            return None
        cp = ps.cp
        tiles = TileMasks(ps.masks, B, cp.S, self.heads, self.layer)

        def offset(rank, local):                     # global minus local position of the run holding `local`
            return next(g - a for a, b, g, _ in cp.runs(rank) if a <= local < b)

        def mask_of(src, r, c):
            return self._grouped_mask(tiles(r, c, offset(None, r.start), offset(src, c.start)))
        return mask_of

    def _grouped_mask(self, mask):
        if mask is None or self.H_kv_i == self.H_i:
            return mask
        return mask.reshape(mask.shape[0], self.H_kv_i, self.H_i // self.H_kv_i, *mask.shape[-2:])

    def backward(self, dout):
        dy = self.proj.backward(dout)                                    # (B, S, H_i hs)
        B, S = dy.shape[:2]
        dy = dy.reshape(B, S, self.H_i, self.hs).transpose(0, 2, 1, 3)  # (B, H_i, S, hs)
        if self.H_kv_i != self.H_i:                                     # grouped: (B, H_kv_i, R_i, S, hs)
            dy = dy.reshape(B, self.H_kv_i, self.H_i // self.H_kv_i, S, self.hs)
        cache, kind = self.take_cache()
        if kind == "online":
            return self._qkv_backward(*ko.online_attention_backward(dy, cache), B, S, dout.dtype)
        if kind == "ring":           # ring attention's backward, with the forward's masks drawn again
            ps = cache[-1]
            return self._qkv_backward(*ring_backward(dy, cache[:7] + (self._ring_masks(B, ps), ps.scale)), B, S,
                                      dout.dtype)
        if self.recompute:           # the attention core again, with the same dropout masks (keyed, redrawn)
            q, k, v, masks = cache
            mask = None if masks is None else masks.head_masks(B, S, self.heads, self.layer)
            _, cache = kern.attention_forward(q, k, v, self._grouped_mask(mask),
                                              1.0 if masks is None else masks.scale, window=self.window)
        dq, dk, dv = kern.attention_backward(dy, cache)                  # dq like q, dk and dv like k and v
        return self._qkv_backward(dq, dk, dv, B, S, dout.dtype)

    def _qkv_backward(self, dq, dk, dv, B, S, dtype):
        """The attention core's gradients (grouped or not) through the rotation and the q/k/v GEMM."""
        dq, dk, dv = self.ungroup(dq), dk.reshape(B, self.H_kv_i, S, self.hs), dv.reshape(B, self.H_kv_i, S, self.hs)
        if self.rope is not None:
            dq, dk = self.rope.backward(dq, dk)
        H_q, H_kv = self.H_i, self.H_kv_i
        dqkv = backend.xp().empty((B, S, (H_q + 2 * H_kv) * self.hs), dtype=dtype)
        heads = dqkv.reshape(B, S, H_q + 2 * H_kv, self.hs)            # a view: [q heads | k heads | v heads]
        for at, n, d in ((0, H_q, dq), (H_q, H_kv, dk), (H_q + H_kv, H_kv, dv)):   # (B, heads, S, hs) each
            heads[:, :, at:at + n] = d.transpose(0, 2, 1, 3)            # one pass, no reshaped copy
        return self.qkv.backward(dqkv)                                   # one GEMM, f's all-reduce
