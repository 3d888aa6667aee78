"""The vocabulary split: the token embedding with its rows cut among the ranks, and the tied output layer."""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.core import kernels as kern
from mpi_tp.core.failpoints import planted
from mpi_tp.core.module import Module
from mpi_tp.core.params import make_param
from mpi_tp.core.weight_grads import weight_grad
from mpi_tp.model.parallel_linear import column_backward, column_forward
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.sequence_parallel import leave_tp, leave_tp_backward
from mpi_tp.parallel.topology import shard_range


class VocabParallelEmbedding(Module):
    """Token embedding with the table split by rows (vocabulary entries).

        wte = [wte_0; ...; wte_{T-1}]      rank i holds rows [V_start, V_start + V_i) of wte (V, C)

    Each rank looks up the tokens that fall in its rows (zeros for the rest);
    g all-reduces, so every rank ends with wte[ids]. The same table serves as the
    tied output layer: `logits_forward` computes x @ wte_i^T, this rank's vocabulary
    columns of the logits, which vocab-parallel cross-entropy consumes unsplit.
    """

    def __init__(self, name, vocab_size, n_embd, group: Group, dtype, *, std=0.02, seed=0):
        self.group = group
        self.sizes, self.start, self.stop = shard_range(vocab_size, group, None, f"{name}: vocabulary")
        self.weight = make_param(name, (vocab_size, n_embd), dtype, std=std, seed=seed,
                                 axis=0, start=self.start, stop=self.stop)          # wte_i: (V_i, C)

    def forward(self, ids, sp=None):
        """(B, S) ids -> (B, S, C), or this rank's positions (B, S_i, C) under sequence parallelism (sp: the
        pass's SequenceSplit)."""
        xp = backend.xp()
        local = ids - self.start                                      # (B, S) row index into wte_i
        if self.group.size > 1 and planted("bug-vocab-offset"):
            local = local + 1                                         # the shard's offset taken one too low
        outside = None
        if self.group.size > 1:
            outside = (local < 0) | (local >= self.stop - self.start)
            local = xp.where(outside, 0, local)
        out, cache = kern.embedding_forward(local, self.weight.data)     # (B, S) -> (B, S, C)
        if outside is not None:
            out[outside] = 0
        out, seq = leave_tp(out, self.group, sp)                        # sp: -> (B, S_i, C)
        self.save_cache(cache, outside, seq)
        return out

    def backward(self, dout):
        cache, outside, seq = self.take_cache()
        dout = leave_tp_backward(dout, self.group, seq)
        weight_grad(self._weights_grad, dout, cache, outside)     # the whole backward is W: ids have no gradient

    def _weights_grad(self, dout, cache, outside):
        if outside is not None:
            dout = dout * ~outside[..., None]                         # rows other ranks own get nothing
        self.weight.accumulate(kern.embedding_backward(dout, cache))

    def logits_forward(self, x, sp=None):
        """Tied output layer: (B, S, C) -> (B, S, V_i) = x @ wte_i^T, a column-parallel layer behind f
        (sp: an all-gather; the input is kept as this rank's positions and gathered again for dwte)."""
        y, self._logits_cache = column_forward(x, self.weight.data.T, None, self.group, sp)
        return y

    def logits_backward(self, dlogits):
        saved, self._logits_cache = getattr(self, "_logits_cache", None), None
        if saved is None:
            raise RuntimeError("VocabParallelEmbedding.logits_backward called without logits_forward")
        return column_backward(dlogits, saved, self.weight.data.T, self.group, self._table_grad)

    def _table_grad(self, dlogits, x):
        """The tied output layer's W: dwte_i = (X^T dlogits)^T, (V_i, C)."""
        dwt, _ = kern.linear_backward_weight(dlogits, x)                    # (C, V_i)
        self.weight.accumulate(dwt.T)
