"""The MLP split: fc column-parallel, GELU on each rank's columns, proj row-parallel."""
from __future__ import annotations

import math

from mpi_tp.core import kernels as kern
from mpi_tp.core.module import Module
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mpi_tp.parallel.topology import Topology


class ParallelMLP(Module):
    """fc (column split, C -> F) -> GELU on each rank's columns -> proj (row split, F -> C) -> g.
    F = cfg.ffn, 4C unless intermediate_size says otherwise."""

    def __init__(self, name, cfg: GPTConfig, topo: Topology, dtype, seed, sp=False):
        C, F = cfg.n_embd, cfg.ffn
        self.fc = ColumnParallelLinear(f"{name}/fc", C, F, topo.tp, dtype, seed=seed)
        self.proj = RowParallelLinear(f"{name}/proj", F, C, topo.tp, dtype, sizes=self.fc.sizes,
                                      seed=seed, std=0.02 / math.sqrt(2 * cfg.n_layer), sp=sp)

    def forward(self, x, ps=None):
        """ps: the micro-batch's Pass (mpi_tp.model.forward_pass), or None (no cut: cached decoding)."""
        sp = None if ps is None else ps.sp
        h = self.fc.forward(x, sp)                 # (B, S, C) -> (B, S, F_i)
        h, cache = kern.gelu_forward(h)
        self.save_cache(cache)
        return self.proj.forward(h, sp)            # (B, S, F_i) -> (B, S, C), all-reduced

    def backward(self, dout):
        dh = self.proj.backward(dout)
        dh = kern.gelu_backward(dh, *self.take_cache())
        return self.fc.backward(dh)
