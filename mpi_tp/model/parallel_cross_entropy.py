"""Vocab-parallel softmax cross-entropy: the loss over logits split by vocabulary, never gathered.

Rank i holds the logits' columns l[:, V_start : V_start + V_i]. Per position (row) j, with
target y_j and row maximum m_j (docs/notation.md, The loss):

    loss_j = log sum_v exp(l_jv - m_j) - (l_j,y_j - m_j),     m_j = max_v l_jv

Three quantities need the whole vocabulary, and each is a sum (or max) of
per-rank parts, so two small all-reduces of N = B*S values replace an
all-gather of N*V logits (Megatron-LM's vocab_parallel_cross_entropy):

    1. m_j                       all-reduce MAX over ranks of the local max
    2. sum_v exp(l_jv - m_j)     all-reduce SUM, fused with
       l_j,y_j - m_j             (only the owner of y_j contributes; others add 0)

The backward needs no communication: dlogits = (softmax - onehot) / N, and each
rank owns its columns of both.

16-bit logits (bf16, fp16: mpi_tp.core.precision) are widened to fp32 first, as Megatron's
`.float()` does: the maximum, the sum-exp, the loss and the kept softmax are fp32 (so are the two
all-reduces), and dlogits is rounded once back to the logits' format.
"""
from __future__ import annotations

from mpi4py import MPI

from mpi_tp.core import backend, memory
from mpi_tp.core.module import Module
from mpi_tp.core.precision import is_half, narrow, widen
from mpi_tp.parallel.collectives import Group


class VocabParallelCrossEntropy(Module):
    """Mean next-token cross-entropy over logits split by vocabulary rows [start, stop)."""

    def __init__(self, group: Group, start: int, stop: int):
        self.group, self.start, self.stop = group, start, stop

    def forward(self, logits, targets) -> float:
        """logits (B, S, V_i), targets (B, S) global token ids -> mean loss (same on every rank)."""
        xp = backend.array_module(logits)
        V_i = logits.shape[-1]
        dtype = logits.dtype
        if is_half(logits):
            logits = widen(logits)                                     # fp32 from here on
        l = logits.reshape(-1, V_i)                                    # (N, V_i)
        N = l.shape[0]
        m = l.max(axis=1)                                              # (N,) local max
        self.group.all_reduce(m, op=MPI.MAX)                           # (N,) global max
        e = l - m[:, None]                                             # (N, V_i) shifted logits
        col = targets.reshape(-1) - self.start                         # (N,) local column of the target
        mine = (col >= 0) & (col < V_i)
        col = xp.where(mine, col, 0)
        rows = xp.arange(N)
        parts = xp.empty((2, N), dtype=l.dtype)
        parts[1] = xp.where(mine, e[rows, col], 0)                     # shifted target logit, owner only
        xp.exp(e, out=e)                                               # (N, V_i) exp(l - m)
        parts[0] = e.sum(axis=1)                                       # local sum-exp
        self.group.all_reduce(parts)                                   # global sum-exp, target logit
        loss = xp.log(parts[0]) - parts[1]                             # (N,)
        e /= parts[0][:, None]                                         # softmax columns of this rank
        self.save_cache(e, col, mine, logits.shape, dtype)
        memory.probe("loss", transient=(logits,))                      # the logits beside their softmax
        return float(loss.mean())

    def backward(self, dloss: float = 1.0):
        """dlogits (B, S, V_i) = dloss * (softmax - onehot(target)) / N, on this rank's columns."""
        probs, col, mine, shape, dtype = self.take_cache()
        xp = backend.array_module(probs)
        N = probs.shape[0]
        rows = xp.arange(N)[mine]
        probs[rows, col[mine]] -= 1.0
        probs *= dloss / N
        return narrow(probs.reshape(shape), dtype) if is_half(dtype) else probs.reshape(shape)
