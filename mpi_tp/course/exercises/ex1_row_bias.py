"""Exercise 1: the row layer's bias.

RowParallelLinear computes Y = X A + b with A split by rows, A = [A_0; ...;
A_{T-1}], and X split by columns to match: rank i holds X_i (B, S, K_i) and
A_i (K_i, C). Each rank's X_i A_i is a partial sum; g (all-reduce forward,
identity backward) adds the T partials. b (C,) is replicated: every rank holds
all of it.

This RowLinear gives a wrong Y when T >= 2. Fix `forward` (and `backward`, if
your fix changes what it needs), then check it (the check also compares what
enters g with the partial sum X_i A_i):

    mpiexec -n 2 mpi-tp exercise 1 --file exercise1.py

Only the regions of mpi_tp.parallel.tensor_parallel communicate: never call
MPI yourself. The lesson: mpiexec -n 2 mpi-tp explain --layer row
"""
from mpi_tp.core import kernels as kern
from mpi_tp.model.parallel_linear import RowParallelLinear
from mpi_tp.parallel.tensor_parallel import reduce_from_tp, reduce_from_tp_backward


class RowLinear(RowParallelLinear):
    """Y = X A + b, A split by rows; the constructor (and the parameters) are RowParallelLinear's."""

    # ======== EXERCISE 1: fix this forward/backward pair ========

    def forward(self, x):
        """x: X_i (B, S, K_i), this rank's columns of X -> Y (B, S, C), the same on every rank."""
        y, cache = kern.linear_forward(x, self.weight.data, self.bias.data)   # (B, S, K_i) -> (B, S, C)
        y = reduce_from_tp(y, self.group)                                  # g: sum over the T ranks
        self.save_cache(cache)
        return y

    def backward(self, dout):
        """dout: dY (B, S, C), the same on every rank -> dX_i (B, S, K_i)."""
        (cache,) = self.take_cache()
        dout = reduce_from_tp_backward(dout, self.group)                   # g's backward: identity
        dx, dw, db = kern.linear_backward(dout, cache)
        self.weight.accumulate(dw)
        self.bias.accumulate(db)
        return dx

    # ======== end of EXERCISE 1 ========
