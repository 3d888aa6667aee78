"""One transformer block: attention and MLP (or mixture of experts), each behind a norm, with residuals.

Legend (docs/notation.md): B = batch, S = sequence (S_i under sequence parallelism), C = channels.

    x = x + drop(attn(ln_1(x)))            heads split: f, q/k/v column, proj row, g
    x = x + drop(mlp(ln_2(x)))             fc column, gelu, proj row, g (or an MoEMLP)

Llama (cfg.llama): ln_1 and ln_2 are RMSNorms, attention rotates q and k (no biases, grouped-query
attention when n_kv_head < n_head), and the MLP is SwiGLU (gate/up column, silu * up, down row, g).

Per block the forward pass all-reduces twice (after attention, after the MLP) and so does the
backward (the two f's), B S C values each (Megatron-LM, sec. 3); under sequence parallelism each
all-reduce becomes an all-gather and a reduce-scatter (mpi_tp.parallel.sequence_parallel).
"""
from __future__ import annotations

from mpi_tp.core.module import Module
from mpi_tp.model.attention import ParallelAttention
from mpi_tp.model.dropout import Dropout, region_mask
from mpi_tp.model.mlp import ParallelMLP
from mpi_tp.model.moe import MoEMLP
from mpi_tp.model.rmsnorm import make_norm
from mpi_tp.model.swiglu import ParallelSwiGLU


class Block(Module):
    """x = x + drop(attn(ln_1(x))); x = x + drop(mlp(ln_2(x))).

    recompute (set by the model for --recompute full): keep only the block's input for
    the backward pass and run the forward again there, collectives and dropout masks
    included (the masks are keyed, so they come out the same).
    """

    recompute = False

    def __init__(self, i, cfg, topo, dtype, seed, dropout: Dropout, sp=None, cp=None):
        name = f"h/{i}"
        self.i, self.dropout, self.sp, self.cp = i, dropout, sp, cp
        self.ln_1 = make_norm(f"{name}/ln_1", cfg, dtype, sp=sp)
        self.attn = ParallelAttention(f"{name}/attn", cfg, topo, dtype, seed, dropout, i, sp, cp)
        self.ln_2 = make_norm(f"{name}/ln_2", cfg, dtype, sp=sp)
        self.moe = cfg.is_moe_block(i)
        mlp = ParallelSwiGLU if cfg.llama else ParallelMLP
        self.mlp = MoEMLP(f"{name}/moe", cfg, topo, dtype, seed, sp) if self.moe else \
            mlp(f"{name}/mlp", cfg, topo, dtype, seed, sp)

    def _residual_drop(self, y, site):
        # Outside the parallel regions: one mask for the whole group (keyed by layer and site only;
        # under sequence parallelism each rank keeps its positions of the whole sequence's mask).
        if not self.dropout.active:
            return y, None
        m = region_mask(self.dropout, y, self.sp, self.i, site, self.cp)
        return self.dropout.apply(y, m), m

    def forward(self, x):
        if not self.recompute:
            return self._forward(x)
        out = self._forward(x)
        self.stash_caches()                          # dropped: the backward computes them again
        self.save_cache(x, self.dropout.key())
        return out

    def _forward(self, x):
        a, m_a = self._residual_drop(self.attn.forward(self.ln_1.forward(x)), 2)
        x = x + a
        h, m_h = self._residual_drop(self.mlp.forward(self.ln_2.forward(x)), 3)
        self.save_cache(m_a, m_h)
        return x + h

    def backward(self, dout):
        if self.recompute:
            x, key = self.take_cache()
            with self.dropout.replay(key):           # the same masks as the first time
                self._forward(x)                     # the caches again (the output is not needed)
        m_a, m_h = self.take_cache()
        dh = dout if m_h is None else self.dropout.apply(dout, m_h)
        dx = dout + self.ln_2.backward(self.mlp.backward(dh))
        da = dx if m_a is None else self.dropout.apply(dx, m_a)
        return dx + self.ln_1.backward(self.attn.backward(da))
