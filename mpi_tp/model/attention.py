"""Causal self-attention split by heads: q/k/v column-parallel, the output projection row-parallel."""
from __future__ import annotations

import math

from mpi_tp.core import backend
from mpi_tp.core import kernels as K
from mpi_tp.core.module import Module
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.dropout import Dropout
from mpi_tp.model.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mpi_tp.parallel.topology import Topology, offsets, split_sizes


class ParallelAttention(Module):
    """Causal self-attention with the heads divided among the tensor-parallel ranks.

    recompute (set by the model for --recompute selective): keep only q, k and v for
    the backward pass and compute the softmax probabilities (and their dropout) again
    there (Korthikanti et al. 2022's selective recomputation: the a s^2 b / t term).
    """

    recompute = False

    def __init__(self, name, cfg: GPTConfig, topo: Topology, dtype, seed, dropout: Dropout, layer: int, sp=None):
        tp = topo.tp
        self.group, self.dropout, self.layer = tp, dropout, layer
        C, H = cfg.n_embd, cfg.n_head
        self.D = C // H
        head_sizes = split_sizes(H, tp.size)
        self.H_i = head_sizes[tp.rank]
        self.heads = range(offsets(head_sizes)[tp.rank], offsets(head_sizes)[tp.rank] + self.H_i)
        cols = [h * self.D for h in head_sizes]   # the q/k/v column split follows the head split
        # q, k and v: three column-parallel layers behind one f, computed as one GEMM (parts)
        self.qkv = ColumnParallelLinear(name, C, C, tp, dtype, sizes=cols, seed=seed, parts=("q", "k", "v"),
                                        sp=sp)
        self.proj = RowParallelLinear(f"{name}/proj", C, C, tp, dtype, sizes=cols, seed=seed,
                                      std=0.02 / math.sqrt(2 * cfg.n_layer), sp=sp)

    def forward(self, x):
        qkv = self.qkv.forward(x)                                        # (B, T, 3 H_i D): [q_i | k_i | v_i]
        B, T = qkv.shape[:2]                                             # T: the whole sequence, also under sp
        qkv = qkv.reshape(B, T, 3, self.H_i, self.D)
        # one copy into head-major order, so that the batched attention products see contiguous heads
        q, k, v = backend.xp().ascontiguousarray(qkv.transpose(2, 0, 3, 1, 4))  # each (B, H_i, T, D)
        mask = (self.dropout.head_masks(B, T, self.heads, x.dtype, self.layer)
                if self.dropout.active else None)
        y, cache = K.attention_forward(q, k, v, mask)                    # (B, H_i, T, D)
        if self.recompute:           # selective recomputation: keep q, k, v, not the (B, H_i, T, T) arrays
            cache = (q, k, v, mask is not None, self.dropout.key())
        self.save_cache(cache)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, self.H_i * self.D)     # (B, T, H_i*D), rank's columns
        return self.proj.forward(y)                                      # row split + g -> (B, T, C)
                                                                         # (sp: reduce-scatter -> (B, T_i, C))

    def backward(self, dout):
        dy = self.proj.backward(dout)                                    # (B, T, H_i*D)
        B, T = dy.shape[:2]
        dy = dy.reshape(B, T, self.H_i, self.D)
        (cache,) = self.take_cache()
        if self.recompute:           # the attention core again, with the same dropout masks (keyed, redrawn)
            q, k, v, masked, key = cache
            mask = None
            if masked:
                with self.dropout.replay(key):
                    mask = self.dropout.head_masks(B, T, self.heads, q.dtype, self.layer)
            _, cache = K.attention_forward(q, k, v, mask)
        grads = K.attention_backward(dy.transpose(0, 2, 1, 3), cache)
        dqkv = backend.xp().empty((B, T, 3, self.H_i, self.D), dtype=dout.dtype)
        for j, d in enumerate(grads):                                    # dq, dk, dv: (B, H_i, T, D)
            dqkv[:, :, j] = d.transpose(0, 2, 1, 3)
        return self.qkv.backward(dqkv.reshape(B, T, 3 * self.H_i * self.D))   # one GEMM, f's all-reduce
