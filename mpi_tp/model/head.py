"""The GPT's last piece (Megatron's post-process): the final norm, the output layer, the loss.

Legend (docs/notation.md): B = batch, S = sequence (S_i under sequence parallelism), C = channels,
V = vocabulary, V_i rank i's vocabulary rows of the table wte.

    logits_i = ln_f(x) @ wte_i^T           tied output layer: this rank's vocabulary columns (f;
                                           sp: an all-gather)
    loss = vocab-parallel cross-entropy     2 small all-reduces, no gather of the logits

Llama: ln_f is an RMSNorm, and the output layer is wte (tied) or, untied (the default), a table of
its own, lm_head (V, C), split over the vocabulary like wte: the same product and the same loss.
"""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.core.module import Module
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.parallel_cross_entropy import VocabParallelCrossEntropy
from mpi_tp.model.parallel_embedding import VocabParallelEmbedding
from mpi_tp.model.rmsnorm import make_norm
from mpi_tp.parallel.topology import Topology


class GPTHead(Module):
    """(B, S, C) activations -> this rank's logits (B, S, V_i), or the loss (a float, every rank alike).

    table: the token embedding wte, the same object as the model's GPTEmbedding's when one chunk
    holds both, else this stage's copy (its gradient is summed with the first stage's after the
    backward pass: mpi_tp.parallel.pipeline.embedding_group); or, untied, the output layer's own
    table lm_head.
    """

    def __init__(self, cfg: GPTConfig, topo: Topology, dtype, table: VocabParallelEmbedding, sp: bool = False):
        self.ln_f = make_norm("ln_f", cfg, dtype, sp=sp and topo.tp.size > 1)
        self.table = table
        self.loss = VocabParallelCrossEntropy(topo.tp, table.start, table.stop)

    def logits(self, x, sp=None):
        """(B, S, C) (under sequence parallelism, sp the pass's SequenceSplit: (B, S_i, C)) -> (B, S, V_i):
        ln_f, then the output layer."""
        return self.table.logits_forward(self.ln_f.forward(x), sp)

    def forward(self, x, targets=None, sp=None):
        logits = self.logits(x, sp)
        if targets is None:
            return logits
        return self.loss.forward(logits, backend.asarray(targets))

    def backward(self, dout=1.0):
        """d(dout * loss)/dx, accumulating the table's and ln_f's gradients."""
        return self.ln_f.backward(self.table.logits_backward(self.loss.backward(dout)))
