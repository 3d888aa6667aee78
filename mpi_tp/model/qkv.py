"""Attention's q, k and v: three column-parallel layers behind one f, split by heads (mpi_tp.model.heads).

Legend (docs/notation.md): B = batch, S = sequence, C = channels, hs = head size, H query heads and
H_kv key/value heads (H_kv = H but for grouped-query attention), T = tensor-parallel size; rank i holds
H_i query heads and H_kv_i key/value heads (mpi_tp.model.heads: H_kv_i = 1 when H_kv < T).
"""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.core import kernels as kern
from mpi_tp.core.module import Module
from mpi_tp.core.params import accumulate_base, fuse_last_axis, make_param
from mpi_tp.model.heads import HeadLayout
from mpi_tp.model.parallel_linear import (
    accumulate_weight,
    column_backward,
    column_forward,
)
from mpi_tp.parallel.topology import Topology


class QKVParallelLinear(Module):
    """[q | k | v] = X [W_q | W_k | W_v] (+ [b_q | b_k | b_v]), each W split by columns, head by head:

        W_q = [W_q,0 | ... | W_q,T-1]  (C, H hs)     rank i: its query heads' columns   (C, H_i hs)
        W_k = [W_k,0 | ... | W_k,T-1]  (C, H_kv hs)     rank i: its key/value heads'       (C, H_kv_i hs)
        W_v  likewise

               X (B, S, C), whole on every rank (sp: all-gathered from (B, S_i, C))
               |
               f        forward: identity     backward: all-reduce dX (sp: reduce-scatter)
               |
        X [W_q,i | W_k,i | W_v,i]   one GEMM -> (B, S, (H_i + 2 H_kv_i) hs): rank i's q, k and v

    The three shards sit side by side in one (C, (H_i + 2 H_kv_i) hs) array (fuse_last_axis), which the
    GEMM reads as it is. When key/value heads are replicated (H_kv < T), W_k,i and W_v,i are the same
    slices on several ranks: they get a storage of their own, (C, 2 hs), marked `replicas` (their
    gradients are summed over the replica group after the backward pass: Param.replicas; their biases
    likewise, Qwen2's), and the
    forward concatenates [W_q,i | W_kv,i] first, a copy of C (H_i + 2) hs weights, small beside the GEMM
    (and the backward again: the copy is not kept).
    """

    def __init__(self, name: str, C: int, hs: int, layout: HeadLayout, topo: Topology, dtype, *, bias: bool,
                 seed: int = 0, std: float = 0.02):
        tp = topo.tp
        self.group, self.hs = tp, hs
        q, kv = layout.q[tp.rank], layout.kv[tp.rank]
        self.H_i, self.H_kv_i = len(q), len(kv)
        replicas = None
        if layout.replicated:                       # the ranks holding my key/value head, as a Group
            replicas = topo.tp_subgroup("kv", [layout.kv[r].start for r in range(tp.size)])

        def param(part, kind, heads, n_heads, rep):
            shape = (C, n_heads * hs) if kind == "weight" else (n_heads * hs,)
            return make_param(f"{name}/{part}/{kind}", shape, dtype, std=std, seed=seed, init="normal" if
                              kind == "weight" else "zeros", axis=len(shape) - 1, start=heads.start * hs,
                              stop=heads.stop * hs, decay=kind == "weight", replicas=rep)
        parts = (("q", q, layout.H, None), ("k", kv, layout.H_kv, replicas), ("v", kv, layout.H_kv, replicas))
        self.weights = [param(p, "weight", *rest) for p, *rest in parts]             # (C, H_i hs), (C, H_kv_i hs) x 2
        self.biases = [param(p, "bias", *rest) for p, *rest in parts] if bias else []
        self.split = replicas is not None
        if self.split:
            fuse_last_axis(self.weights[1:])                                           # (C, 2 hs)
            if bias:
                fuse_last_axis(self.biases[1:])                                        # (2 hs,)
        else:
            fuse_last_axis(self.weights)                                               # (C, (H_i + 2 H_kv_i) hs)
            if bias:
                fuse_last_axis(self.biases)

    @property
    def weight(self):
        return self.weights[0]

    @property
    def out_features(self) -> int:
        return (self.H_i + 2 * self.H_kv_i) * self.hs

    def _fused_weight(self):
        if not self.split:
            return self.weights[0].base
        return backend.xp().concatenate([self.weights[0].base, self.weights[1].base], axis=1)

    def _fused_bias(self):
        if not self.biases or not self.split:
            return self.biases[0].base if self.biases else None
        return backend.xp().concatenate([self.biases[0].base, self.biases[1].base])

    def forward(self, x, sp=None):
        """x (B, S, C) (sp, the pass's SequenceSplit: (B, S_i, C)) -> q (B, S, H_i, hs), k and v
        (B, S, H_kv_i, hs): views of one array."""
        b = self._fused_bias()
        y, cache = column_forward(x, self._fused_weight(), b, self.group, sp)    # (B, S, (H_i + 2 H_kv_i) hs)
        self.save_cache(cache)
        B, S = y.shape[:2]
        n_q, n_kv = self.H_i * self.hs, self.H_kv_i * self.hs
        return (y[..., :n_q].reshape(B, S, self.H_i, self.hs),
                y[..., n_q:n_q + n_kv].reshape(B, S, self.H_kv_i, self.hs),
                y[..., n_q + n_kv:].reshape(B, S, self.H_kv_i, self.hs))

    def backward(self, dqkv):
        """dqkv (B, S, (H_i + 2 H_kv_i) hs), the gradients of [q | k | v] side by side -> dX (B, S, C) (sp: its
        positions), after f's all-reduce; the weights' and biases' gradients accumulated."""
        (cache,) = self.take_cache()
        return column_backward(dqkv, cache, self._fused_weight(), self.group, self._weights_grad)   # split: made again

    def _weights_grad(self, dqkv, x):
        """The q/k/v weights' and biases' gradients from X and d[q | k | v] (W)."""
        has_bias = bool(self.biases)
        if not self.split:
            db = accumulate_weight(self.weights, lambda dw_out: kern.linear_backward_weight(dqkv, x, has_bias, dw_out))
        else:
            dw, db = kern.linear_backward_weight(dqkv, x, has_bias)                  # dw (C, (H_i + 2) hs)
            n_q = self.H_i * self.hs
            accumulate_base(self.weights[:1], dw[:, :n_q])
            accumulate_base(self.weights[1:], dw[:, n_q:])
            if has_bias:                                   # replicated k|v biases: summed over their replicas too
                accumulate_base(self.biases[:1], db[:n_q])
                accumulate_base(self.biases[1:], db[n_q:])
                return
        if has_bias:
            accumulate_base(self.biases, db)
