"""The GPT's first piece (Megatron's pre-process): token and position embeddings, dropped out.

Legend (docs/notation.md): B = batch, S = sequence (S_i under sequence parallelism), C = channels,
V = vocabulary, wte the token table (vocabulary-parallel: rank i holds rows wte_i), wpe the
position table (replicated).

    x = drop(wte[idx] + wpe[0:S])         wte's lookup ends in g (an all-reduce; sp: reduce-scatter)
    x = drop(wte[idx])                    llama: no position table (attention rotates q and k instead)

Only a pipeline's first stage holds it; the last stage's GPTHead uses the same table (tied), or a
copy of it when the two are on different stages.
"""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.core.module import Module
from mpi_tp.core.params import make_param
from mpi_tp.core.precision import sum_rows
from mpi_tp.core.weight_grads import weight_grad
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.model.dropout import region_mask
from mpi_tp.model.forward_pass import Pass
from mpi_tp.model.parallel_embedding import VocabParallelEmbedding
from mpi_tp.parallel.topology import Topology


class GPTEmbedding(Module):
    """(B, S) token ids -> drop(wte[idx] + wpe[0:S]): (B, S, C), or this rank's positions (B, S_i, C)
    under sequence parallelism (wpe's gradient is then a partial sum: Param.sp_partial); under context
    parallelism (cp) the ids of this rank's chunks, at their global positions (B, S_r, C)."""

    def __init__(self, cfg: GPTConfig, topo: Topology, dtype, seed: int, sp: bool = False):
        self.block_size = cfg.block_size
        self.wte = VocabParallelEmbedding("wte", cfg.vocab_size, cfg.n_embd, topo.tp, dtype, seed=seed)
        self.wpe = None if cfg.llama else make_param("wpe", (cfg.block_size, cfg.n_embd), dtype, seed=seed,
                                                     sp_partial=sp and topo.tp.size > 1)

    def forward(self, idx, ps: Pass):
        """idx (B, S) of the micro-batch whose pass is ps (its cuts of the positions, its masks)."""
        B, S = idx.shape
        if S > self.block_size:
            raise ConfigError(f"sequence length {S} exceeds block_size {self.block_size}")
        idx = backend.asarray(idx)
        positions = slice(0, S)
        if ps.cp is not None:        # context parallelism: this rank's chunks, at their global positions
            idx = ps.cp.take(idx)
            positions = backend.asarray(ps.cp.positions)
        if ps.sp is not None:
            positions = ps.sp.positions if ps.cp is None else positions[ps.sp.positions]
        x = self.wte.forward(idx, ps.sp)                                # (B, S, C) or (B, S_i, C)
        if self.wpe is not None:
            x += self.wpe.data[positions]
        m = None
        if ps.masks is not None:
            m = region_mask(ps.masks, x, ps.sp, -1, 0, ps.cp)
            x = ps.masks.apply(x, m)
        self.save_cache(positions, m, ps.masks)
        return x

    def backward(self, dx):
        """Accumulate wte's and wpe's gradients; nothing to return (token ids have no gradient)."""
        positions, m, masks = self.take_cache()
        if m is not None:
            dx = masks.apply(dx, m)
        if self.wpe is not None:
            weight_grad(self._wpe_grad, dx, positions)
        self.wte.backward(dx)

    def _wpe_grad(self, dx, positions):
        self.wpe.grad[positions] += sum_rows(dx)              # over the batch (fp32 sum at 16 bits)
        self.wpe.fresh = False

    def lookup(self, ids, positions):
        """Inference (cached decoding): ids (B, t) at positions (t,) (every row alike) or (B, 1) (one per row),
        on the device -> (B, t, C), without dropout or sequence parallelism."""
        x = self.wte.forward(ids)
        if self.wpe is not None:
            x += self.wpe.data[positions]
        return x
