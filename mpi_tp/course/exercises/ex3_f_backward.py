"""Exercise 3: the column layer's input gradient.

ColumnParallelLinear computes Y = X A + b with A split by columns,
A = [A_0 | ... | A_{T-1}]: rank i holds A_i (C, O_i) and b_i, and computes
its columns Y_i = X A_i + b_i. X (B, S, C) is whole on every rank: it enters
through f (identity forward, all-reduce backward).

In this ColumnLinear the output and the weight gradients are right, but the
gradient of X is not. Fix `forward`/`backward`, then check it:

    mpiexec -n 2 mpi-tp exercise 3 --file exercise3.py

The lesson: mpiexec -n 2 mpi-tp explain --layer column
"""
from mpi_tp.core import kernels as kern
from mpi_tp.model.parallel_linear import ColumnParallelLinear
from mpi_tp.parallel.tensor_parallel import copy_to_tp


class ColumnLinear(ColumnParallelLinear):
    """Y_i = X A_i + b_i; the constructor (and the parameters) are ColumnParallelLinear's."""

    # ======== EXERCISE 3: fix this forward/backward pair ========

    def forward(self, x):
        """x: X (B, S, C), whole on every rank -> Y_i (B, S, O_i), this rank's columns of Y."""
        x = copy_to_tp(x, self.group)                                      # f: identity forward
        y, cache = kern.linear_forward(x, self.weight.data, self.bias.data)
        self.save_cache(cache)
        return y

    def backward(self, dout):
        """dout: dY_i (B, S, O_i), this rank's columns of dY -> dX (B, S, C), the same on every rank."""
        (cache,) = self.take_cache()
        dx, dw, db = kern.linear_backward(dout, cache)
        self.weight.accumulate(dw)
        self.bias.accumulate(db)
        return dx

    # ======== end of EXERCISE 3 ========
