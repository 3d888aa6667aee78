"""A mixture-of-experts block's experts: the block's MLP, split like it, without its communication.

Legend (docs/notation.md): C = channels, F = cfg.ffn an expert's width, F_i rank i's columns of it,
R_e the rows (token assignments) expert e received. Split over its group: etp for a routed expert
(mpi_tp.parallel.expert_tensor), tp for the shared ones. MoEMLP (mpi_tp.model.moe) gathers the rows and
sums the partial outputs once for all of a rank's experts; an expert's forward returns this rank's
partial sum, before that sum (and the proj bias, added once after it: `proj_bias`, None when there is
none).

    Expert (gpt2):        X A_fc,i + b_fc,i -> GELU -> @ A_proj,i            fc column, proj row
    SwiGLUExpert (llama): X [A_gate,i | A_up,i] -> silu(g) * u -> @ A_down,i  gate/up column (one GEMM),
                                                                             down row, no biases
"""
from __future__ import annotations

import math

from mpi_tp.core import kernels as kern
from mpi_tp.core import kernels_llama as kl
from mpi_tp.core.module import Module
from mpi_tp.core.params import accumulate_base, fuse_last_axis, make_param
from mpi_tp.core.weight_grads import weight_grad
from mpi_tp.parallel.topology import shard_range


class Expert(Module):
    """One GELU expert: the dense MLP's parameters and split (fc column-parallel, proj row-parallel), without
    its communication: MoEMLP gathers and sums once for all its experts. forward returns this rank's
    partial sum X_e A_fc,i -> gelu -> @ A_proj,i, before that sum and the proj bias. tp: the group it is
    split over (etp for a routed expert)."""

    def __init__(self, name, cfg, tp, dtype, seed):
        C, F = cfg.n_embd, cfg.ffn
        _, start, stop = shard_range(F, tp, None, f"{name}: expert width")
        self.fc_weight = make_param(f"{name}/fc/weight", (C, F), dtype, seed=seed, axis=1, start=start,
                                    stop=stop, decay=True)                                  # (C, F_i)
        self.fc_bias = make_param(f"{name}/fc/bias", (F,), dtype, init="zeros", axis=0, start=start, stop=stop)
        self.proj_weight = make_param(f"{name}/proj/weight", (F, C), dtype, std=0.02 / math.sqrt(2 * cfg.n_layer),
                                      seed=seed, axis=0, start=start, stop=stop, decay=True)  # (F_i, C)
        self.proj_bias = make_param(f"{name}/proj/bias", (C,), dtype, init="zeros")      # replicated

    def forward(self, x):
        h, fc = kern.linear_forward(x, self.fc_weight.data, self.fc_bias.data)   # (R_e, C) -> (R_e, F_i)
        h, act = kern.gelu_forward(h)
        y, proj = kern.linear_forward(h, self.proj_weight.data)                 # (R_e, F_i) -> (R_e, C) partial
        self.save_cache(fc[0], act, proj[0])                                   # the inputs, not the weights
        return y

    def backward(self, dout):
        x, act, h = self.take_cache()
        dh = kern.gelu_backward(kern.linear_backward_input(dout, self.proj_weight.data), act)   # (R_e, F_i)
        weight_grad(self._weights_grad, dout, h, dh, x)
        return kern.linear_backward_input(dh, self.fc_weight.data)          # (R_e, C), partial over the group

    def _weights_grad(self, dout, h, dh, x):
        """W: proj's weight from (h, dout), fc's weight and bias from (x, dh)."""
        self.proj_weight.accumulate(kern.linear_backward_weight(dout, h)[0])
        dw, db = kern.linear_backward_weight(dh, x, True)
        self.fc_weight.accumulate(dw)
        self.fc_bias.accumulate(db)


class SwiGLUExpert(Module):
    """One SwiGLU expert (llama's MLP): gate and up column-parallel, side by side in one (C, 2 F_i) array
    (one GEMM), silu(gate) * up on each rank's F_i columns, down row-parallel; no biases. forward returns
    this rank's partial sum, before MoEMLP's sum over the group."""

    proj_bias = None

    def __init__(self, name, cfg, tp, dtype, seed):
        C, F = cfg.n_embd, cfg.ffn
        _, start, stop = shard_range(F, tp, None, f"{name}: expert width")
        self.gate_up = [make_param(f"{name}/{part}/weight", (C, F), dtype, seed=seed, axis=1, start=start,
                                   stop=stop, decay=True) for part in ("gate", "up")]     # (C, F_i) each
        fuse_last_axis(self.gate_up)                                                    # (C, 2 F_i)
        self.down_weight = make_param(f"{name}/down/weight", (F, C), dtype, std=0.02 / math.sqrt(2 * cfg.n_layer),
                                      seed=seed, axis=0, start=start, stop=stop, decay=True)  # (F_i, C)

    def forward(self, x):
        gu, fc = kern.linear_forward(x, self.gate_up[0].base)                   # (R_e, C) -> (R_e, 2 F_i)
        F_i = gu.shape[-1] // 2
        h, act = kl.swiglu_forward(gu[:, :F_i], gu[:, F_i:])                      # (R_e, F_i)
        y, down = kern.linear_forward(h, self.down_weight.data)                 # (R_e, F_i) -> (R_e, C) partial
        self.save_cache(fc[0], act, down[0])                                   # the inputs, not the weights
        return y

    def backward(self, dout):
        x, act, h = self.take_cache()
        dgu = kl.swiglu_backward(kern.linear_backward_input(dout, self.down_weight.data), act)   # (R_e, 2 F_i)
        weight_grad(self._weights_grad, dout, h, dgu, x)
        return kern.linear_backward_input(dgu, self.gate_up[0].base)         # (R_e, C), partial over the group

    def _weights_grad(self, dout, h, dgu, x):
        """W: down's weight from (h, dout), gate/up's from (x, [dgate | dup])."""
        self.down_weight.accumulate(kern.linear_backward_weight(dout, h)[0])
        accumulate_base(self.gate_up, kern.linear_backward_weight(dgu, x)[0])
