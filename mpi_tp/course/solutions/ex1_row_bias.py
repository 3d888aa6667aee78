"""Exercise 1, solved: the row layer adds its bias once, after g has summed the partials.

Adding b inside each rank's partial sum X_i A_i + b makes g add it T times:
Y = X A + T b. The bias is replicated, so it goes on after the reduce; its
gradient is the sum of dY over the positions, the same on every rank.
"""
from mpi_tp.core import kernels as kern
from mpi_tp.model.parallel_linear import RowParallelLinear
from mpi_tp.parallel.tensor_parallel import reduce_from_tp, reduce_from_tp_backward


class RowLinear(RowParallelLinear):
    """Y = X A + b, A split by rows; the constructor (and the parameters) are RowParallelLinear's."""

    def forward(self, x):
        """x: X_i (B, S, K_i), this rank's columns of X -> Y (B, S, C), the same on every rank."""
        y, cache = kern.linear_forward(x, self.weight.data)                   # partial sum X_i A_i
        y = reduce_from_tp(y, self.group)                                  # g: sum over the T ranks
        y += self.bias.data                                                # once, after the reduce
        self.save_cache(cache)
        return y

    def backward(self, dout):
        """dout: dY (B, S, C), the same on every rank -> dX_i (B, S, K_i)."""
        (cache,) = self.take_cache()
        self.bias.accumulate(dout.reshape(-1, dout.shape[-1]).sum(axis=0))
        dout = reduce_from_tp_backward(dout, self.group)                   # g's backward: identity
        dx, dw, _ = kern.linear_backward(dout, cache)
        self.weight.accumulate(dw)
        return dx
