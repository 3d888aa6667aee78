"""The SwiGLU MLP (llama) split: gate and up column-parallel in one GEMM, silu(gate) * up, down row-parallel."""
from __future__ import annotations

import math

from mpi_tp.core import kernels_llama as kl
from mpi_tp.core.module import Module
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mpi_tp.parallel.topology import Topology


class ParallelSwiGLU(Module):
    """down(silu(x W_gate) * (x W_up)), no biases (Shazeer 2020; Llama's MLP):

        [g_i | u_i] = x [W_gate,i | W_up,i]     column split, C -> F: one GEMM behind f, (B, S, 2 F_i)
        h_i = silu(g_i) * u_i                    on each rank's F_i columns, no communication
        out = sum_i h_i W_down,i                 row split, F -> C, then g (all-reduce)

    Rank i's columns of gate and up are the same F_i of the F (uneven shares allowed), so the
    elementwise product pairs them without communication, as GELU does in the GPT-2 MLP.
    """

    def __init__(self, name, cfg: GPTConfig, topo: Topology, dtype, seed, sp=False):
        C, F = cfg.n_embd, cfg.ffn
        self.fc = ColumnParallelLinear(name, C, F, topo.tp, dtype, bias=False, seed=seed, parts=("gate", "up"))
        # {name}/gate/weight, {name}/up/weight
        self.down = RowParallelLinear(f"{name}/down", F, C, topo.tp, dtype, bias=False, sizes=self.fc.sizes,
                                      seed=seed, std=0.02 / math.sqrt(2 * cfg.n_layer), sp=sp)

    def forward(self, x, ps=None):
        sp = None if ps is None else ps.sp
        gu = self.fc.forward(x, sp)                    # (B, S, C) -> (B, S, 2 F_i): [gate_i | up_i]
        F_i = gu.shape[-1] // 2
        h, cache = kl.swiglu_forward(gu[..., :F_i], gu[..., F_i:])     # (B, S, F_i)
        self.save_cache(cache)
        return self.down.forward(h, sp)            # (B, S, F_i) -> (B, S, C), all-reduced

    def backward(self, dout):
        dh = self.down.backward(dout)              # (B, S, F_i)
        return self.fc.backward(kl.swiglu_backward(dh, *self.take_cache()))   # (B, S, 2 F_i), as fc's output
