"""RMSNorm (llama): replicated on every rank of the tensor-parallel group, a weight and no bias."""
from __future__ import annotations

from mpi_tp.core import kernels_llama as kl
from mpi_tp.core.module import Module
from mpi_tp.core.params import make_param
from mpi_tp.core.weight_grads import weight_grad
from mpi_tp.model.layernorm import LayerNorm


class RMSNorm(Module):
    """out = x / sqrt(mean(x^2) + eps) * w over channels, replicated on every rank.

    sp: under sequence parallelism (over more than one rank) each rank normalises its own positions, so
    its weight gradient is a partial sum (Param.sp_partial), completed after the backward pass, as LayerNorm's."""

    def __init__(self, name: str, n: int, dtype, eps: float = 1e-5, sp: bool = False):
        self.weight = make_param(f"{name}/weight", (n,), dtype, init="ones",
                                 sp_partial=bool(sp))
        self.eps = eps

    def forward(self, x):
        out, cache = kl.rmsnorm_forward(x, self.weight.data, self.eps)
        xhat, _, rstd = cache
        self.save_cache(xhat, rstd)                  # not the weight (ZeRO-3 lets it go): read again below
        return out

    def backward(self, dout):
        xhat, rstd = self.take_cache()
        cache = (xhat, self.weight.data, rstd)
        weight_grad(self._weights_grad, dout, cache)
        return kl.rmsnorm_backward_input(dout, cache)

    def _weights_grad(self, dout, cache):
        self.weight.accumulate(kl.rmsnorm_backward_weight(dout, cache))


def make_norm(name: str, cfg, dtype, sp: bool = False):
    """The architecture's normalisation: LayerNorm (gpt2) or RMSNorm (llama), eps = cfg.norm_eps."""
    if cfg.llama:
        return RMSNorm(name, cfg.n_embd, dtype, cfg.norm_eps, sp)
    return LayerNorm(name, cfg.n_embd, dtype, cfg.norm_eps, sp)
