"""The column split and the row split: Megatron's two tensor-parallel linear layers.

Legend (docs/notation.md): B = batch, S = sequence, K = input features, O =
output features, T = tensor-parallel size, ranks i = 0 ... T-1. A subscript i
is rank i's share, in one notation for blocks and sizes: A_i is the block of A
that rank i holds, O_i and K_i the number of columns and rows in it, S_i its
positions under sequence parallelism. Shards may be uneven (sizes differ by at
most one unit); `sizes` lists every rank's share.

Communication happens only in the regions of `mpi_tp.parallel.tensor_parallel`
(f, g, scatter, gather) and their sequence-parallel forms; nothing here calls
MPI directly.
"""
from __future__ import annotations

from mpi_tp.core import kernels as kern
from mpi_tp.core.failpoints import planted
from mpi_tp.core.module import Module
from mpi_tp.core.params import accumulate_base, fuse_last_axis, make_param
from mpi_tp.core.precision import sum_rows
from mpi_tp.core.weight_grads import deferring_now, weight_grad
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.sequence_parallel import (
    enter_tp,
    enter_tp_backward,
    leave_tp,
    leave_tp_backward,
    regather_from_sp,
    start_gather_from_sp_backward,
)
from mpi_tp.parallel.tensor_parallel import (
    gather_from_tp,
    gather_from_tp_backward,
    scatter_to_tp,
    scatter_to_tp_backward,
)
from mpi_tp.parallel.topology import shard_range


def column_forward(x, w, b, group: Group, sp):
    """Y_i = X A_i + b_i behind f (or, under sequence parallelism, an all-gather of the positions):
    x (B, S, K), or (B, S_i, K) under sp -> (B, S, O_i), and what the backward needs.

    Under sp the cache keeps this rank's input shard (B, S_i, K), not the gathered (B, S, K): the
    backward gathers it again (Korthikanti et al. 2022, sec. 4.2.2), so the layer holds 1/T of it. The
    cache keeps no weight: the backward is handed it again (under ZeRO-3 gathered again, so a block's
    whole weights need not live from its forward to its backward).
    """
    x_in, seq = enter_tp(x, group, sp)                               # sp: (B, S_i, K) -> (B, S, K)
    y, (_, _, has_bias) = kern.linear_forward(x_in, w, b)              # (B, S, K) -> (B, S, O_i)
    kept = x_in if seq is None else x                                # sp: the shard, not the gathered copy
    return y, (kept, has_bias, seq, sp is not None and sp.overlap)


def column_backward(dout, cache, w, group: Group, weights):
    """dX (f's all-reduce, or sp's reduce-scatter: this rank's positions), returned, w the forward's A_i;
    the weights' and biases' gradients by weights(dout, X), X the whole input (under sp gathered again), handed to
    weight_grad: now, or at a zero-bubble schedule's W action (mpi_tp.core.weight_grads).

    Under sp, with overlap (SequenceSplit.overlap) and W not deferred, as Megatron does: start the input's
    all-gather, compute dX = dY A_i^T meanwhile, wait; start dX's reduce-scatter, compute the weights'
    gradients meanwhile, wait. Otherwise dX and its collective first, then W: (sp) the input's all-gather
    and the weights' gradients.
    """
    x, _, seq, overlap = cache
    if seq is not None and overlap and not deferring_now():
        gathering = regather_from_sp(x, group, seq)                   # (B, S_i, K) -> (B, S, K), started
        dx = kern.linear_backward_input(dout, w)                     # (B, S, O_i) -> (B, S, K) partial
        x_whole = gathering.wait()
        reducing = start_gather_from_sp_backward(dx, group, seq)      # -> (B, S_i, K), started
        weights(dout, x_whole)
        return reducing.wait()
    dx = enter_tp_backward(kern.linear_backward_input(dout, w), group, seq)   # f: all-reduce dX (sp: scatter)
    weight_grad(_gathered_weights_grad, weights, dout, x, group, seq)
    return dx


def _gathered_weights_grad(weights, dout, x, group: Group, seq):
    """W of a column layer: its input whole again (under sp, an all-gather of the kept shard), then dA_i, db_i."""
    weights(dout, x if seq is None else regather_from_sp(x, group, seq).wait())


def accumulate_weight(weights, weight_backward):
    """Run weight_backward(dw_out) -> (dw, db) and accumulate dw into the weights' (shared) gradient: while
    that still holds zeros, the GEMM writes straight into it (no new array, no extra pass). Returns db."""
    grad = weights[0].grad_base
    fresh = all(p.fresh for p in weights)
    dw, db = weight_backward(grad if fresh else None)
    if not fresh:
        accumulate_base(weights, dw)
    for p in weights:
        p.fresh = False
    return db


class ColumnParallelLinear(Module):
    """Y = X A + b with A split by columns (its output features):

        A = [A_0 | ... | A_{T-1}]          b = [b_0 | ... | b_{T-1}]

               X (B, S, K), whole on every rank
               |
               f        forward: identity     backward: all-reduce dX
             / | \\
        X A_0 + b_0 ... X A_{T-1} + b_{T-1}   -> Y_i (B, S, O_i), rank i's columns of Y
               |
             gather (optional): Y = [Y_0 ... Y_{T-1}] (all-gather), else Y_i stays split

    The weight is stored (in, out) so that y = x @ A + b. Rank i holds A_i (K, O_i).

    parts: several column-parallel layers that read the same X, computed as one.
    parts=("q", "k", "v") makes three parameters {name}/q/weight, ... (each (K, O),
    split as above) whose shards sit side by side in one (K, 3 O_i) array, so
    that one GEMM gives the rank's [q_i | k_i | v_i] columns and the backward
    needs one GEMM and one all-reduce for dX instead of three.
    """

    def __init__(self, name, in_features, out_features, group: Group, dtype, *, bias=True,
                 gather_output=False, sizes=None, std=0.02, seed=0, parts=None):
        self.group = group
        self.sizes, start, stop = shard_range(out_features, group, sizes, f"{name}: output features")
        self.gather_output = gather_output
        if parts and gather_output:
            raise ValueError(f"{name}: gather_output needs a single part")
        names = [f"{name}/{part}" for part in parts] if parts else [name]
        self.weights = [make_param(f"{n}/weight", (in_features, out_features), dtype, std=std, seed=seed,
                                   axis=1, start=start, stop=stop, decay=True)      # A_i: (K, O_i)
                        for n in names]
        self.biases = [make_param(f"{n}/bias", (out_features,), dtype, init="zeros", axis=0,
                                  start=start, stop=stop) for n in names] if bias else []   # b_i: (O_i,)
        if parts:
            fuse_last_axis(self.weights)                              # (K, parts * O_i)
            if bias:
                fuse_last_axis(self.biases)

    @property
    def weight(self):
        return self.weights[0]

    @property
    def bias(self):
        return self.biases[0] if self.biases else None

    def forward(self, x, sp=None):
        """x (B, S, K), or this rank's positions (B, S_i, K) under sequence parallelism (sp: the pass's
        SequenceSplit) -> (B, S, O_i)."""
        b = self.biases[0].base if self.biases else None
        y, cache = column_forward(x, self.weights[0].base, b, self.group, sp)   # -> (B, S, parts * O_i)
        self.save_cache(cache)
        if self.gather_output:
            y = gather_from_tp(y, self.group, self.sizes)             # (B, S, O_i) -> (B, S, O)
        return y

    def backward(self, dout):
        if self.gather_output:
            dout = gather_from_tp_backward(dout, self.group, self.sizes)
        (cache,) = self.take_cache()
        return column_backward(dout, cache, self.weights[0].base, self.group, self._weights_grad)

    def _weights_grad(self, dout, x):
        """dA_i = X^T dY and db_i, accumulated (W)."""
        has_bias = bool(self.biases)
        db = accumulate_weight(self.weights, lambda dw_out: kern.linear_backward_weight(dout, x, has_bias, dw_out))
        if has_bias:
            accumulate_base(self.biases, db)


class RowParallelLinear(Module):
    """Y = X A + b with A split by rows (its input features) and X split to match:

        A = [A_0        X = [X_0 | ... | X_{T-1}]
             ...
             A_{T-1}]   Y = X_0 A_0 + ... + X_{T-1} A_{T-1} + b

        X_i (B, S, K_i) on rank i  ->  X_i A_i  (B, S, O), a partial sum
               |
               g        forward: all-reduce      backward: identity
               |
             + b        added once, after the reduce (b is replicated)

    input_is_parallel=False means X arrives whole and each rank first keeps its
    columns X_i (scatter; the backward all-gathers dX).
    """

    def __init__(self, name, in_features, out_features, group: Group, dtype, *, bias=True,
                 input_is_parallel=True, sizes=None, std=0.02, seed=0, sp=False):
        """sp: sequence parallelism on (the bias then sees this rank's positions only: Param.sp_partial)."""
        self.group = group
        self.sizes, start, stop = shard_range(in_features, group, sizes, f"{name}: input features")
        self.input_is_parallel = input_is_parallel
        self.weight = make_param(f"{name}/weight", (in_features, out_features), dtype, std=std, seed=seed,
                                 axis=0, start=start, stop=stop, decay=True)        # A_i: (K_i, O)
        self.bias = make_param(f"{name}/bias", (out_features,), dtype, init="zeros",     # b: (O,), whole
                               sp_partial=bool(sp) and group.size > 1) if bias else None

    def forward(self, x, sp=None):
        """(B, S, K_i) -> (B, S, O) summed over the group, or this rank's positions (B, S_i, O) under
        sequence parallelism (sp: the pass's SequenceSplit)."""
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, self.sizes)              # (B, S, K) -> (B, S, K_i)
        y, (x_kept, _, _) = kern.linear_forward(x, self.weight.data)     # (B, S, K_i) -> (B, S, O) partial
        early = self.bias is not None and self.group.size > 1 and planted("bug-bias-before-reduce")
        if early:
            y += self.bias.data
        y, seq = leave_tp(y, self.group, sp)                            # sp: -> (B, S_i, O), this rank's positions
        self.save_cache(x_kept, seq)                                    # not the weight: read again below
        if self.bias is not None and not early:
            y += self.bias.data
        return y

    def backward(self, dout):
        x, seq = self.take_cache()
        whole = leave_tp_backward(dout, self.group, seq)                # sp: (B, S_i, O) -> (B, S, O)
        dx = kern.linear_backward_input(whole, self.weight.data)        # (B, S, O) -> (B, S, K_i)
        weight_grad(self._weights_grad, dout, whole, x)
        if not self.input_is_parallel:
            dx = scatter_to_tp_backward(dx, self.group, self.sizes)
        return dx

    def _weights_grad(self, dout, whole, x):
        """db from this rank's positions (sp: a partial sum, Param.sp_partial) and dA_i = X_i^T dY (W)."""
        if self.bias is not None:
            self.bias.accumulate(sum_rows(dout.reshape(-1, dout.shape[-1])))     # fp32 sum at 16 bits
        accumulate_weight([self.weight], lambda dw_out: kern.linear_backward_weight(whole, x, False, dw_out))
