"""Exercise 4, solved: V_start is the sum of the shards before rank i, not i (V // T).

With V = 37 and T = 3 the shards are 13, 12, 12 rows: rank 1 starts at 13, not
12. i (V // T) makes rank 0's last row rank 1's first as well (looked up twice
and summed by g) and leaves the last V % T rows to no rank (zeros).
"""
import numpy

from mpi_tp.core import kernels as kern
from mpi_tp.core.module import Module
from mpi_tp.core.params import make_param
from mpi_tp.parallel.tensor_parallel import reduce_from_tp, reduce_from_tp_backward


def vocab_range(V, T, i):
    """(V_start, V_start + V_i): the rows of the vocabulary that rank i of T holds."""
    V_i = V // T + (1 if i < V % T else 0)
    V_start = i * (V // T) + min(i, V % T)        # the ranks before i, each V // T rows, one more for the first V % T
    return V_start, V_start + V_i


class Embedding(Module):
    """ids (B, S) -> wte[ids] (B, S, C) on every rank, wte split by rows over `group`."""

    def __init__(self, name, V, C, group, dtype, seed):
        self.group = group
        self.start, self.stop = vocab_range(V, group.size, group.rank)
        self.weight = make_param(name, (V, C), dtype, seed=seed, axis=0,
                                 start=self.start, stop=self.stop)          # wte_i: (V_i, C)

    def forward(self, ids):
        local = ids - self.start                                          # row of wte_i, if it is here
        outside = (local < 0) | (local >= self.stop - self.start)
        out, cache = kern.embedding_forward(numpy.where(outside, 0, local), self.weight.data)
        out[outside] = 0                                                  # other ranks' tokens
        self.save_cache(cache, outside)
        return reduce_from_tp(out, self.group)                            # g: each token from its owner

    def backward(self, dout):
        cache, outside = self.take_cache()
        dout = reduce_from_tp_backward(dout, self.group) * ~outside[..., None]
        self.weight.accumulate(kern.embedding_backward(dout, cache))
