"""Exercise 4: uneven vocabulary shards and their offset.

The token embedding wte (V, C) is split by rows: rank i holds the V_i rows
[V_start, V_start + V_i). When T does not divide V the shards differ by one row:
the first V % T ranks hold one more (mpi_tp.parallel.topology.split_sizes). Each
rank looks up the tokens that fall in its rows (zeros for the others) and g
all-reduces, so every rank ends with wte[ids].

With V = 37 this Embedding gives wrong vectors for some tokens. Fix
`vocab_range` (and `Embedding` if needed), then check it:

    mpiexec -n 3 mpi-tp exercise 4 --file exercise4.py

Lesson: docs/learn.md, sections 4 (uneven shards) and 5 (the vocabulary).
"""
import numpy

from mpi_tp.core import kernels as kern
from mpi_tp.core.module import Module
from mpi_tp.core.params import make_param
from mpi_tp.parallel.tensor_parallel import reduce_from_tp, reduce_from_tp_backward

# ======== EXERCISE 4: fix vocab_range (and Embedding, if needed) ========


def vocab_range(V, T, i):
    """(V_start, V_start + V_i): the rows of the vocabulary that rank i of T holds."""
    V_i = V // T + (1 if i < V % T else 0)
    V_start = i * (V // T)
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

# ======== end of EXERCISE 4 ========
