"""The tied embedding across pipeline stages: Megatron's embedding group.

The token table wte serves twice: the first stage looks tokens up in it, the
last stage multiplies by it (the tied output layer). When those are different
stages, each holds a copy (same name, same initial values), and each copy's
backward pass gives only its own part of the gradient. The serial model's one
table has the sum of both, so after the backward pass the copies' gradients
are summed over the stages that hold one (an all-reduce over a group of the
first and the last stage, `emb/embedding_all_reduce`): both then make the same
update and stay equal. With the interleaved schedule on one stage (P = 1,
v > 1) both copies are on one rank and are summed in place.
"""
from __future__ import annotations

from mpi4py import MPI

from mpi_tp.core.failpoints import planted
from mpi_tp.parallel.collectives import Group


class TiedEmbedding:
    """This stage's copies of wte (`tables`: VocabParallelEmbedding objects, 0, 1 or 2) and the group of
    stages holding one; sum_grads() gives every copy the sum of all copies' gradients."""

    def __init__(self, tables: list, pp: Group, stats):
        self.tables = tables
        holds = bool(tables) and pp.size > 1
        sub = pp.comm.Split(0 if holds else MPI.UNDEFINED, key=pp.rank)      # collective over pp
        self.group = Group(sub, "emb", stats) if holds else None

    def sum_grads(self) -> None:
        if len(self.tables) == 0 or (len(self.tables) == 1 and self.group is None):
            return
        total = self.tables[0].weight.grad.copy()
        for t in self.tables[1:]:
            total += t.weight.grad
        if self.group is not None and not planted("bug-tied-embedding"):
            self.group.all_reduce(total, kind="embedding_all_reduce")
        for t in self.tables:
            t.weight.grad[...] = total
            t.weight.fresh = False

    def sum_shares(self, buckets) -> None:
        """ZeRO-3 (whole gradients are gone after the backward): the same sum over the copies' buckets'
        shares, each copy a bucket of its own and cut alike on every stage (buckets.tied_copies)."""
        mine = [b for b in buckets if any(p is t.weight for t in self.tables for _, _, ps in b.stores for p in ps)]
        if len(mine) == 0 or (len(mine) == 1 and self.group is None):
            return
        total = mine[0].grad_share.copy()
        for b in mine[1:]:
            total += b.grad_share
        if self.group is not None and not planted("bug-tied-embedding"):
            self.group.all_reduce(total, kind="embedding_all_reduce")
        for b in mine:
            b.grad_share[...] = total
