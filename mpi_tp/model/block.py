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

from dataclasses import replace

from mpi_tp.core import memory
from mpi_tp.core.failpoints import planted
from mpi_tp.core.module import Module
from mpi_tp.model.attention import ParallelAttention
from mpi_tp.model.dropout import region_mask
from mpi_tp.model.forward_pass import NO_PASS, Pass
from mpi_tp.model.mlp import ParallelMLP
from mpi_tp.model.moe import MoEMLP
from mpi_tp.model.rmsnorm import make_norm
from mpi_tp.model.swiglu import ParallelSwiGLU


class Block(Module):
    """x = x + drop(attn(ln_1(x))); x = x + drop(mlp(ln_2(x))).

    recompute (set by the model for --recompute full): keep only the block's input (and its
    pass) for the backward pass and run the forward again there, collectives and dropout
    masks included (the masks are keyed by the pass, so they come out the same).
    """

    recompute = False

    def __init__(self, i, cfg, topo, dtype, seed, sp: bool = False):
        """sp: sequence parallelism on (the norms' weights then see this rank's positions only)."""
        name = f"h/{i}"
        self.i = i
        partial = sp and topo.tp.size > 1
        self.ln_1 = make_norm(f"{name}/ln_1", cfg, dtype, sp=partial)
        self.attn = ParallelAttention(f"{name}/attn", cfg, topo, dtype, seed, i, sp)
        self.ln_2 = make_norm(f"{name}/ln_2", cfg, dtype, sp=partial)
        self.moe = cfg.is_moe_block(i)
        mlp = ParallelSwiGLU if cfg.llama else ParallelMLP
        self.mlp = MoEMLP(f"{name}/moe", cfg, topo, dtype, seed) if self.moe else \
            mlp(f"{name}/mlp", cfg, topo, dtype, seed, sp)

    def _residual_drop(self, y, site, ps: Pass):
        # Outside the parallel regions: one mask for the whole group (keyed by layer and site only;
        # under sequence parallelism each rank keeps its positions of the whole sequence's mask).
        if ps.masks is None:
            return y, None
        m = region_mask(ps.masks, y, ps.sp, self.i, site, ps.cp)
        return ps.masks.apply(y, m), m

    def forward(self, x, ps: Pass = NO_PASS):
        """x (B, S, C), or this rank's positions (B, S_i, C) of its micro-batch's pass ps."""
        if not self.recompute:
            return self._forward(x, ps)
        out = self._forward(x, ps)
        self.stash_caches()                          # dropped: the backward computes them again
        self.save_cache(x, ps)
        return out

    def _forward(self, x, ps: Pass):
        a, m_a = self._residual_drop(self.attn.forward(self.ln_1.forward(x), ps), 2, ps)
        x = x + a
        h, m_h = self._residual_drop(self.mlp.forward(self.ln_2.forward(x), ps), 3, ps)
        self.save_cache(m_a, m_h, ps.masks)
        return x + h

    def backward(self, dout):
        if self.recompute:
            x, ps = self.take_cache()
            if planted("bug-dropout-replay") and ps.masks is not None:
                ps = replace(ps, masks=replace(ps.masks, step=ps.masks.step + 1))
            self._forward(x, ps)                     # the caches again, the same masks (the output is not needed)
            memory.probe("recompute")               # one block's caches rebuilt: the peak of full recomputation
        m_a, m_h, masks = self.take_cache()
        dh = dout if m_h is None else masks.apply(dout, m_h)
        dx = dout + self.ln_2.backward(self.mlp.backward(dh))
        da = dx if m_a is None else masks.apply(dx, m_a)
        return dx + self.ln_1.backward(self.attn.backward(da))
