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
        self._sum_in_place([t.weight.grad for t in self.tables])
        for t in self.tables:
            t.weight.fresh = False

    def sum_shares(self, buckets) -> None:
        """ZeRO-3 (whole gradients are gone after the backward): the same sum over the copies' buckets'
        shares, each copy a bucket of its own and cut alike on every stage (buckets.tied_copies)."""
        mine = [b for b in buckets if any(p is t.weight for t in self.tables for _, _, ps in b.stores for p in ps)]
        self._sum_in_place([b.grad_share for b in mine])

    def _sum_in_place(self, copies: list) -> None:
        """Every array in `copies` (this stage's) becomes the sum of all copies on all stages holding one."""
        if len(copies) == 0 or (len(copies) == 1 and self.group is None):
            return
        total = copies[0].copy()
        for c in copies[1:]:
            total += c
        if self.group is not None and not planted("bug-tied-embedding"):
            self.group.all_reduce(total, kind="embedding_all_reduce")
        for c in copies:
            c[...] = total
