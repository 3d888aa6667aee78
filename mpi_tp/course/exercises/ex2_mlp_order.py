"""Exercise 2: the order of the MLP's two split layers.

The MLP is fc (C -> F, F = 4C), GELU, proj (F -> C). Megatron splits one of the
two layers by columns and the other by rows, so that the first one's output
shards are exactly the second one's input shards and the MLP communicates once
each way (one g forward, one f backward).

This MLP puts the two splits in the wrong order. Fix `__init__` (and
`forward`/`backward` if needed), then check it:

    mpiexec -n 2 mpi-tp exercise 2 --file exercise2.py

Keep the names "{name}/fc" and "{name}/proj": they key the parameters' initial
values, so that the serial MLP gets the same weights. The lesson:
mpiexec -n 2 mpi-tp explain --layer mlp
"""
from mpi_tp.core import kernels as kern
from mpi_tp.core.module import Module
from mpi_tp.model.parallel_linear import ColumnParallelLinear, RowParallelLinear


class MLP(Module):
    """fc -> GELU -> proj over the tensor-parallel group topo.tp; X and Y (B, S, C) whole on every rank."""

    # ======== EXERCISE 2: fix the order of the splits ========

    def __init__(self, name, cfg, topo, dtype, seed):
        C = cfg.n_embd
        self.fc = RowParallelLinear(f"{name}/fc", C, 4 * C, topo.tp, dtype, seed=seed)
        self.proj = ColumnParallelLinear(f"{name}/proj", 4 * C, C, topo.tp, dtype, seed=seed)

    def forward(self, x):
        h = self.fc.forward(x)
        h, cache = kern.gelu_forward(h)
        self.save_cache(cache)
        return self.proj.forward(h)

    def backward(self, dout):
        dh = self.proj.backward(dout)
        dh = kern.gelu_backward(dh, *self.take_cache())
        return self.fc.backward(dh)

    # ======== end of EXERCISE 2 ========
