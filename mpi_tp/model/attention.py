"""Causal self-attention split by heads: q/k/v column-parallel, the output projection row-parallel."""
from __future__ import annotations

import math

from mpi_tp.core import backend
from mpi_tp.core import kernels as kern
from mpi_tp.core.module import Module
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.dropout import Dropout
from mpi_tp.model.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mpi_tp.parallel.topology import Topology, offsets, split_sizes


class ParallelAttention(Module):
    """Causal self-attention with the heads divided among the tensor-parallel ranks.

    recompute (set by the model for --recompute selective): keep only q, k and v for
    the backward pass and compute the softmax probabilities (and their dropout) again
    there (Korthikanti et al. 2022's selective recomputation: the H S^2 B / T term).
    """

    recompute = False

    def __init__(self, name, cfg: GPTConfig, topo: Topology, dtype, seed, dropout: Dropout, layer: int, sp=None):
        tp = topo.tp
        self.group, self.dropout, self.layer = tp, dropout, layer
        C, H = cfg.n_embd, cfg.n_head
        self.hs = C // H
        head_sizes = split_sizes(H, tp.size)
        self.H_i = head_sizes[tp.rank]
        self.heads = range(offsets(head_sizes)[tp.rank], offsets(head_sizes)[tp.rank] + self.H_i)
        cols = [h * self.hs for h in head_sizes]  # the q/k/v column split follows the head split
        # q, k and v: three column-parallel layers behind one f, computed as one GEMM (parts)
        self.qkv = ColumnParallelLinear(name, C, C, tp, dtype, sizes=cols, seed=seed, parts=("q", "k", "v"),
                                        sp=sp)
        self.proj = RowParallelLinear(f"{name}/proj", C, C, tp, dtype, sizes=cols, seed=seed,
                                      std=0.02 / math.sqrt(2 * cfg.n_layer), sp=sp)

    def forward(self, x):
        qkv = self.qkv.forward(x)                                        # (B, S, 3 H_i hs): [q_i | k_i | v_i]
        B, S = qkv.shape[:2]                                             # S: the whole sequence, also under sp
        qkv = qkv.reshape(B, S, 3, self.H_i, self.hs)
        # one copy into head-major order, so that the batched attention products see contiguous heads
        q, k, v = backend.xp().ascontiguousarray(qkv.transpose(2, 0, 3, 1, 4))  # each (B, H_i, S, hs)
        mask = (self.dropout.head_masks(B, S, self.heads, self.layer)     # bool (B, H_i, S, S): this
                if self.dropout.active else None)                        # rank's heads only
        y, cache = kern.attention_forward(q, k, v, mask, self.dropout.scale)   # (B, H_i, S, hs)
        if self.recompute:           # selective recomputation: keep q, k, v, not the (B, H_i, S, S) arrays
            cache = (q, k, v, mask is not None, self.dropout.key())
        self.save_cache(cache)
        y = y.transpose(0, 2, 1, 3).reshape(B, S, self.H_i * self.hs)    # (B, S, H_i hs), rank's columns
        return self.proj.forward(y)                                      # row split + g -> (B, S, C)
                                                                         # (sp: reduce-scatter -> (B, S_i, C))

    def backward(self, dout):
        dy = self.proj.backward(dout)                                    # (B, S, H_i hs)
        B, S = dy.shape[:2]
        dy = dy.reshape(B, S, self.H_i, self.hs)
        (cache,) = self.take_cache()
        if self.recompute:           # the attention core again, with the same dropout masks (keyed, redrawn)
            q, k, v, masked, key = cache
            mask = None
            if masked:
                with self.dropout.replay(key):
                    mask = self.dropout.head_masks(B, S, self.heads, self.layer)
            _, cache = kern.attention_forward(q, k, v, mask, self.dropout.scale)
        grads = kern.attention_backward(dy.transpose(0, 2, 1, 3), cache)
        dqkv = backend.xp().empty((B, S, 3, self.H_i, self.hs), dtype=dout.dtype)
        for j, d in enumerate(grads):                                    # dq, dk, dv: (B, H_i, S, hs)
            dqkv[:, :, j] = d.transpose(0, 2, 1, 3)
        return self.qkv.backward(dqkv.reshape(B, S, 3 * self.H_i * self.hs))   # one GEMM, f's all-reduce
