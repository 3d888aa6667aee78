"""LayerNorm: replicated on every rank of the tensor-parallel group (each holds the whole weight)."""
from __future__ import annotations

from mpi_tp.core import kernels as kern
from mpi_tp.core.module import Module
from mpi_tp.core.params import make_param
from mpi_tp.core.weight_grads import weight_grad


class LayerNorm(Module):
    """LayerNorm over channels, replicated on every rank: out = (x - mean) * rstd * w + b.

    sp: under sequence parallelism (over more than one rank) each rank normalises its own positions, so
    its weight and bias gradients are partial sums (Param.sp_partial), completed after the backward pass."""

    def __init__(self, name: str, n: int, dtype, eps: float = 1e-5, sp: bool = False):
        partial = bool(sp)
        self.weight = make_param(f"{name}/weight", (n,), dtype, init="ones", sp_partial=partial)
        self.bias = make_param(f"{name}/bias", (n,), dtype, init="zeros", sp_partial=partial)
        self.eps = eps

    def forward(self, x):
        out, cache = kern.layernorm_forward(x, self.weight.data, self.bias.data, self.eps)
        xhat, _, rstd = cache
        self.save_cache(xhat, rstd)                  # not the weight (ZeRO-3 lets it go): read again below
        return out

    def backward(self, dout):
        xhat, rstd = self.take_cache()
        cache = (xhat, self.weight.data, rstd)
        weight_grad(self._weights_grad, dout, cache)
        return kern.layernorm_backward_input(dout, cache)

    def _weights_grad(self, dout, cache):
        dw, db = kern.layernorm_backward_weight(dout, cache)
        self.weight.accumulate(dw)
        self.bias.accumulate(db)
