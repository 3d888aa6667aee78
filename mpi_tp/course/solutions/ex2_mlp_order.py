"""Exercise 2, solved: fc split by columns, proj by rows over the same F_i columns.

fc's output shard H_i (B, S, F_i) is exactly proj's input shard, so GELU runs on
each rank's columns with no communication, and the MLP needs one all-reduce
forward (g after proj) and one backward (f's, before fc). Rows first would need
the input split (a scatter) and the column layer's output gathered: more traffic.
"""
from mpi_tp.core import kernels as kern
from mpi_tp.core.module import Module
from mpi_tp.model.parallel_linear import ColumnParallelLinear, RowParallelLinear


class MLP(Module):
    """fc -> GELU -> proj over the tensor-parallel group topo.tp; X and Y (B, S, C) whole on every rank."""

    def __init__(self, name, cfg, topo, dtype, seed):
        C = cfg.n_embd
        self.fc = ColumnParallelLinear(f"{name}/fc", C, 4 * C, topo.tp, dtype, seed=seed)
        self.proj = RowParallelLinear(f"{name}/proj", 4 * C, C, topo.tp, dtype, sizes=self.fc.sizes, seed=seed)

    def forward(self, x):
        h = self.fc.forward(x)                     # (B, S, C) -> (B, S, F_i), behind f
        h, cache = kern.gelu_forward(h)
        self.save_cache(cache)
        return self.proj.forward(h)                # (B, S, F_i) -> (B, S, C), g

    def backward(self, dout):
        dh = self.proj.backward(dout)
        dh = kern.gelu_backward(dh, *self.take_cache())
        return self.fc.backward(dh)                # f's backward: all-reduce of dX
