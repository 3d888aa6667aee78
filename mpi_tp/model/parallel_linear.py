"""Tensor-parallel layers: the column split, the row split, and the vocabulary split.

Legend: B = batch, T = sequence, C = channels, V = vocabulary, p = tensor-parallel
size, K_p / M_p / V_p = this rank's share of a split dimension. Shards may be
uneven (sizes differ by at most one unit); `sizes` lists every rank's share.

Communication happens only in the regions of `comm` (f, g, scatter, gather);
nothing here calls MPI directly.
"""
from __future__ import annotations

from . import backend
from . import kernels as K
from .comm import (Group, copy_to_tp, copy_to_tp_backward, gather_from_sp, gather_from_sp_backward,
                   gather_from_tp, gather_from_tp_backward, reduce_from_tp, reduce_from_tp_backward,
                   reduce_scatter_to_sp, reduce_scatter_to_sp_backward, scatter_to_tp, scatter_to_tp_backward)
from .module import Module
from .params import accumulate_base, fuse_last_axis, make_param
from .topology import check_splittable, offsets, split_sizes


class SequenceSplit:
    """Sequence parallelism's cut of the positions among the tensor-parallel ranks.

    Set once per forward pass (the sequence length may change between calls) and
    read by every layer of the model; shards differ by at most one position.
    """

    def __init__(self, group: Group):
        self.group, self.sizes = group, None

    def set(self, S: int) -> None:
        self.sizes = split_sizes(S, self.group.size)

    @property
    def positions(self) -> slice:
        """This rank's positions: a slice of the sequence axis."""
        start = offsets(self.sizes)[self.group.rank]
        return slice(start, start + self.sizes[self.group.rank])


def _enter(x, group, sp):
    """Into a tensor-parallel region: f (x whole) or, under sequence parallelism, an all-gather."""
    if sp is not None:
        return gather_from_sp(x, group, sp.sizes), sp.sizes
    return copy_to_tp(x, group), None


def _enter_backward(dx, group, sizes):
    if sizes is not None:
        return gather_from_sp_backward(dx, group, sizes)
    return copy_to_tp_backward(dx, group)


def _leave(y, group, sp):
    """Out of a tensor-parallel region: g (all-reduce) or, under sequence parallelism, a reduce-scatter."""
    if sp is not None:
        return reduce_scatter_to_sp(y, group, sp.sizes), sp.sizes
    return reduce_from_tp(y, group), None


def _leave_backward(dout, group, sizes):
    if sizes is not None:
        return reduce_scatter_to_sp_backward(dout, group, sizes)
    return reduce_from_tp_backward(dout, group)


def _shard(n: int, group: Group, sizes, what: str):
    """(sizes, start, stop) of this rank's shard of a dimension of n units."""
    if sizes is None:
        check_splittable(n, group.size, what)
        sizes = split_sizes(n, group.size)
    if len(sizes) != group.size or sum(sizes) != n or min(sizes) < 1:
        raise ValueError(f"{what}: shard sizes {sizes} do not cut {n} units over {group.size} ranks")
    start = offsets(sizes)[group.rank]
    return list(sizes), start, start + sizes[group.rank]


def _linear_backward(dout, cache, weights):
    """linear_backward, accumulating dW into the weights' (shared) gradient: while that still
    holds zeros, the GEMM writes straight into it (no new array, no extra pass)."""
    grad = weights[0].grad_base
    fresh = all(p.fresh for p in weights)
    dx, dw, db = K.linear_backward(dout, cache, dw_out=grad if fresh else None)
    if not fresh:
        accumulate_base(weights, dw)
    for p in weights:
        p.fresh = False
    return dx, db


class LayerNorm(Module):
    """LayerNorm over channels, replicated on every rank: out = (x - mean) * rstd * w + b."""

    def __init__(self, name: str, n: int, dtype, eps: float = 1e-5):
        self.weight = make_param(f"{name}/weight", (n,), dtype, init="ones")
        self.bias = make_param(f"{name}/bias", (n,), dtype, init="zeros")
        self.eps = eps

    def forward(self, x):
        out, cache = K.layernorm_forward(x, self.weight.data, self.bias.data, self.eps)
        self.save_cache(cache)
        return out

    def backward(self, dout):
        dx, dw, db = K.layernorm_backward(dout, *self.take_cache())
        self.weight.accumulate(dw)
        self.bias.accumulate(db)
        return dx


class ColumnParallelLinear(Module):
    """Y = X A + b with A split by columns (its output features):

        A = [A_1 | A_2 | ... | A_p]        b = [b_1 | ... | b_p]

               X (B, T, K), whole on every rank
               |
               f        forward: identity     backward: all-reduce dX
             / | \\
        X A_1 + b_1 ... X A_p + b_p   -> Y_i (B, T, M_i), rank i's columns of Y
               |
             gather (optional): Y = [Y_1 ... Y_p] (all-gather), else Y_i stays split

    The weight is stored (in, out) so that y = x @ A + b. Rank i holds A_i (K, M_i).

    parts: several column-parallel layers that read the same X, computed as one.
    parts=("q", "k", "v") makes three parameters {name}/q/weight, ... (each (K, M),
    split as above) whose shards sit side by side in one (K, 3 M_i) array, so
    that one GEMM gives the rank's [q_i | k_i | v_i] columns and the backward
    needs one GEMM and one all-reduce for dX instead of three.
    """

    def __init__(self, name, in_features, out_features, group: Group, dtype, *, bias=True,
                 gather_output=False, sizes=None, std=0.02, seed=0, parts=None, sp=None):
        self.group, self.sp = group, sp
        self.sizes, start, stop = _shard(out_features, group, sizes, f"{name}: output features")
        self.gather_output = gather_output
        if parts and gather_output:
            raise ValueError(f"{name}: gather_output needs a single part")
        names = [f"{name}/{part}" for part in parts] if parts else [name]
        self.weights = [make_param(f"{n}/weight", (in_features, out_features), dtype, std=std, seed=seed,
                                   axis=1, start=start, stop=stop, decay=True)      # A_i: (K, M_i)
                        for n in names]
        self.biases = [make_param(f"{n}/bias", (out_features,), dtype, init="zeros", axis=0,
                                  start=start, stop=stop) for n in names] if bias else []   # b_i: (M_i,)
        if parts:
            fuse_last_axis(self.weights)                              # (K, parts * M_i)
            if bias:
                fuse_last_axis(self.biases)

    @property
    def weight(self):
        return self.weights[0]

    @property
    def bias(self):
        return self.biases[0] if self.biases else None

    def forward(self, x):
        x, seq = _enter(x, self.group, self.sp)                       # sp: (B, S_i, K) -> (B, S, K)
        b = self.biases[0].base if self.biases else None
        y, cache = K.linear_forward(x, self.weights[0].base, b)       # (B, T, K) -> (B, T, parts * M_i)
        self.save_cache(cache, seq)
        if self.gather_output:
            y = gather_from_tp(y, self.group, self.sizes)             # (B, T, M_i) -> (B, T, M)
        return y

    def backward(self, dout):
        if self.gather_output:
            dout = gather_from_tp_backward(dout, self.group, self.sizes)
        cache, seq = self.take_cache()
        dx, db = _linear_backward(dout, cache, self.weights)
        if self.biases:
            accumulate_base(self.biases, db)
        return _enter_backward(dx, self.group, seq)


class RowParallelLinear(Module):
    """Y = X A + b with A split by rows (its input features) and X split to match:

        A = [A_1        X = [X_1 | ... | X_p]
             ...
             A_p]       Y = X_1 A_1 + ... + X_p A_p + b

        X_i (B, T, K_i) on rank i  ->  X_i A_i  (B, T, M), a partial sum
               |
               g        forward: all-reduce      backward: identity
               |
             + b        added once, after the reduce (b is replicated)

    input_is_parallel=False means X arrives whole and each rank first keeps its
    columns X_i (scatter; the backward all-gathers dX).
    """

    def __init__(self, name, in_features, out_features, group: Group, dtype, *, bias=True,
                 input_is_parallel=True, sizes=None, std=0.02, seed=0, sp=None):
        self.group, self.sp = group, sp
        self.sizes, start, stop = _shard(in_features, group, sizes, f"{name}: input features")
        self.input_is_parallel = input_is_parallel
        self.weight = make_param(f"{name}/weight", (in_features, out_features), dtype, std=std, seed=seed,
                                 axis=0, start=start, stop=stop, decay=True)        # A_i: (K_i, M)
        self.bias = make_param(f"{name}/bias", (out_features,), dtype, init="zeros") if bias else None

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, self.sizes)              # (B, T, K) -> (B, T, K_i)
        y, cache = K.linear_forward(x, self.weight.data)              # (B, T, K_i) -> (B, T, M) partial
        y, seq = _leave(y, self.group, self.sp)                       # sp: -> (B, S_i, M), this rank's positions
        self.save_cache(cache, seq)
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, dout):
        if self.bias is not None:
            self.bias.accumulate(dout.reshape(-1, dout.shape[-1]).sum(axis=0))
        cache, seq = self.take_cache()
        dout = _leave_backward(dout, self.group, seq)
        dx, _ = _linear_backward(dout, cache, [self.weight])
        if not self.input_is_parallel:
            dx = scatter_to_tp_backward(dx, self.group, self.sizes)
        return dx


class VocabParallelEmbedding(Module):
    """Token embedding with the table split by rows (vocabulary entries).

        E = [E_1; ...; E_p]      rank i holds rows [v_i, v_i + V_i) of E (V, C)

    Each rank looks up the tokens that fall in its rows (zeros for the rest);
    g all-reduces, so every rank ends with E[ids]. The same table serves as the
    tied output layer: `logits_forward` computes x @ E_i^T, this rank's vocabulary
    columns of the logits, which vocab-parallel cross-entropy consumes unsplit.
    """

    def __init__(self, name, vocab_size, n_embd, group: Group, dtype, *, std=0.02, seed=0, sp=None):
        self.group, self.sp = group, sp
        self.sizes, self.start, self.stop = _shard(vocab_size, group, None, f"{name}: vocabulary")
        self.weight = make_param(name, (vocab_size, n_embd), dtype, std=std, seed=seed,
                                 axis=0, start=self.start, stop=self.stop)          # E_i: (V_i, C)

    def forward(self, ids):
        xp = backend.xp()
        local = ids - self.start                                      # (B, T) row index into E_i
        outside = None
        if self.group.size > 1:
            outside = (local < 0) | (local >= self.stop - self.start)
            local = xp.where(outside, 0, local)
        out, cache = K.embedding_forward(local, self.weight.data)     # (B, T) -> (B, T, C)
        if outside is not None:
            out[outside] = 0
        out, seq = _leave(out, self.group, self.sp)                   # sp: -> (B, S_i, C)
        self.save_cache(cache, outside, seq)
        return out

    def backward(self, dout):
        cache, outside, seq = self.take_cache()
        dout = _leave_backward(dout, self.group, seq)
        if outside is not None:
            dout = dout * ~outside[..., None]                         # rows other ranks own get nothing
        self.weight.accumulate(K.embedding_backward(dout, cache))

    def logits_forward(self, x):
        """Tied output layer: (B, T, C) -> (B, T, V_i) = x @ E_i^T, behind f (sp: an all-gather)."""
        x, seq = _enter(x, self.group, self.sp)
        y, cache = K.linear_forward(x, self.weight.data.T)
        self._logits_cache = cache, seq
        return y

    def logits_backward(self, dlogits):
        saved, self._logits_cache = getattr(self, "_logits_cache", None), None
        if saved is None:
            raise RuntimeError("VocabParallelEmbedding.logits_backward called without logits_forward")
        cache, seq = saved
        dx, dwt, _ = K.linear_backward(dlogits, cache)                # dwt: (C, V_i)
        self.weight.accumulate(dwt.T)
        return _enter_backward(dx, self.group, seq)
