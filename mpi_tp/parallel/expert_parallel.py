"""Expert parallelism: a mixture-of-experts layer's experts divided among the expert-parallel group,
tokens carried to them and back by all-to-all (GShard, Lepikhin et al. 2020; Switch Transformer).

Legend: C = channels, E = experts, ep = the expert-parallel group's size (topo.ep), E_i = the
experts rank i holds (split_sizes(E, ep): experts [o_i, o_i + E_i), the first E % ep ranks one
more), n_send = rows this rank sends (one per admitted (token, expert) assignment), n_recv = rows
it receives.

    rank r: x_send (n_send, C), rows     ---- dispatch ---->      rank s: x_recv (n_recv, C),
            sorted by expert (so by      (Alltoall of counts,             grouped by local expert
            destination rank too)         Alltoallv of rows)                |
                                                                         its experts
                                                                            |
    rank r: y_send (n_send, C), in    <---- combine ----          rank s: y_recv (n_recv, C)
            x_send's order               (the inverse Alltoallv: counts known)

Both are linear maps that only move rows, so each one's gradient is the other:
the backward of combine is a dispatch and the backward of dispatch a combine,
with the same plan. Per MoE layer and step: one Alltoall of counts (int64) and
four Alltoallv of rows (two forward, two backward), each moving
rows x C x itemsize bytes per row that leaves the rank.

The groups come from the experts' own grid (mpi_tp.parallel.expert_grid: a stage's tp x cp x dp
ranks laid out again as etp x ep x edp). Every rank routes its own positions (mpi_tp.model.moe);
after the dispatch, an expert's etp group gathers its members' rows, computes its column/row shards
on all of them, and reduce-scatters the partial outputs back, so each shard sees the same rows.

Expert parameters carry an `ExpertShard` mark (`p.expert`): the data-parallel
reducer sums their gradients over `edp` (the ranks holding the same shard)
instead of dp x cp, then divides by dp x cp like the rest (the edp sum holds every
token of the stage once); the gradient norm sums their squares over etp (the shards
of one expert) and ep (the experts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from mpi_tp.core import backend
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.topology import TopologyError, offsets, split_sizes


@dataclass(frozen=True)
class ExpertShard:
    """What marks a Param as (an etp shard of) expert `index`'s: it lives on one member of `ep` and, when
    sharded, on one member of `etp` (sum its gradient's squares over both for the norm) and is replicated
    over `edp` (sum its gradient there, not over the dense gradient's group)."""

    index: int
    ep: Group
    edp: Group
    etp: Group


def mark_expert(params, index: int, topo) -> None:
    """Mark expert `index`'s parameters (p.expert = ExpertShard), for the reducer and the norm."""
    for p in params:
        p.expert = ExpertShard(index, topo.ep, topo.edp, topo.etp)


def expert_of(p) -> ExpertShard | None:
    """The ExpertShard of an expert parameter, None for a dense one."""
    return getattr(p, "expert", None)


@dataclass
class DispatchPlan:
    """Who sends how many rows to whom, for one dispatch and its combine (data, host integers).

    send_rows[r]: rows this rank sends to ep rank r; recv_rows[r]: rows it receives from r;
    expert_rows[j]: received rows for its local expert j (sum n_recv); order: the permutation that
    turns the received rows (source-major) into expert-major order (None with one rank)."""

    send_rows: list
    recv_rows: list
    expert_rows: list
    order: object


class ExpertDispatcher:
    """Carries rows to the ranks holding their experts and back, over the expert-parallel group."""

    def __init__(self, n_experts: int, group: Group):
        if n_experts < group.size:
            raise TopologyError(f"{n_experts} experts cannot be divided among {group.size} expert-parallel "
                                f"ranks: some rank would hold none; use ep <= {n_experts}")
        self.group, self.n_experts = group, n_experts
        self.sizes = split_sizes(n_experts, group.size)            # E_i for every rank
        self.starts = offsets(self.sizes)                          # o_i
        self.local = range(self.starts[group.rank], self.starts[group.rank] + self.sizes[group.rank])

    def plan(self, per_expert) -> DispatchPlan:
        """per_expert (E,): rows this rank sends to each expert (its rows sorted by expert). The
        counts travel first (one Alltoall of E_max = max E_i integers per pair of ranks)."""
        per_expert = numpy.asarray(backend.asnumpy(per_expert), dtype=numpy.int64)
        ep, wide = self.group.size, max(self.sizes)
        counts = numpy.zeros((ep, wide), dtype=numpy.int64)         # block r: rows for rank r's experts
        for r in range(ep):
            counts[r, :self.sizes[r]] = per_expert[self.starts[r]:self.starts[r] + self.sizes[r]]
        got = self.group.all_to_all(counts)[:, :len(self.local)]   # (ep, E_i): from source s, per local expert
        send_rows = [int(n) for n in counts.sum(axis=1)]
        recv_rows = [int(n) for n in got.sum(axis=1)]
        order = None
        if ep > 1:   # received blocks are (source, expert); the experts want (expert, source)
            start = numpy.cumsum(got.reshape(-1)) - got.reshape(-1)            # each block's first row
            start = start.reshape(got.shape)
            order = numpy.concatenate([numpy.arange(start[s, j], start[s, j] + got[s, j])
                                       for j in range(got.shape[1]) for s in range(ep)] + [numpy.zeros(0, int)])
            order = backend.asarray(order.astype(numpy.int64))
        return DispatchPlan(send_rows, recv_rows, [int(n) for n in got.sum(axis=0)], order)

    def dispatch(self, x_send, plan: DispatchPlan):
        """x_send (n_send, C), sorted by expert -> x_recv (n_recv, C): the rows for this rank's experts,
        expert by expert."""
        x_recv = self.group.all_to_allv(x_send, plan.send_rows, plan.recv_rows)
        return x_recv if plan.order is None else x_recv[plan.order]

    def combine(self, y_recv, plan: DispatchPlan):
        """y_recv (n_recv, C), expert by expert -> y_send (n_send, C): every row back to its sender, in
        x_send's order."""
        if plan.order is not None:
            by_source = backend.array_module(y_recv).empty_like(y_recv)
            by_source[plan.order] = y_recv
            y_recv = by_source
        return self.group.all_to_allv(y_recv, plan.recv_rows, plan.send_rows)

    # Each is the other's gradient: they only move rows.
    dispatch_backward = combine
    combine_backward = dispatch


@dataclass
class GatherPlan:
    """Every rank's rows, for one all-gather dispatch and its combine (data, host integers).

    rows[r]: rows ep rank r sends (its admitted assignments, sorted by expert); expert_rows[j]: rows of the
    gathered array for local expert j; order: which gathered rows those are, expert by expert, in the order
    the all-to-all's plan gives them (by source, then the source's order), so both dispatchers hand the
    experts the same rows in the same order."""

    rows: list
    expert_rows: list
    order: object


class GatherDispatcher(ExpertDispatcher):
    """The all-gather dispatcher (Megatron's --moe-token-dispatcher-type allgather): every rank gathers every
    ep rank's rows, its experts take theirs, and a reduce-scatter brings each result back to its sender (the
    other ranks add zeros to a row: its sum is exact). It moves every row to every rank, ep times the
    all-to-all's wire bytes when the routing is uniform, with two collectives that need no count exchange ahead of
    the rows (the row counts travel in one small all-gather); identical outputs (tests/test_moe.py)."""

    def plan(self, per_expert) -> GatherPlan:
        """per_expert (E,): rows this rank sends to each expert. One all-gather of E integers."""
        per_expert = numpy.asarray(backend.asnumpy(per_expert), dtype=numpy.int64)
        table = self.group.all_gather(per_expert[None, :], [1] * self.group.size, axis=0,
                                      kind="all_gather_counts")           # (ep, E): source s, expert e
        rows = [int(n) for n in table.sum(axis=1)]
        first = numpy.cumsum(table.reshape(-1)) - table.reshape(-1)          # each (source, expert) block's row
        first = first.reshape(table.shape)
        order = numpy.concatenate([numpy.arange(first[s, e], first[s, e] + table[s, e])
                                   for e in self.local for s in range(self.group.size)] + [numpy.zeros(0, int)])
        return GatherPlan(rows, [int(table[:, e].sum()) for e in self.local],
                          backend.asarray(order.astype(numpy.int64)))

    def dispatch(self, x_send, plan: GatherPlan):
        """x_send (n_send, C), sorted by expert -> x_recv (n_recv, C): this rank's experts' rows of all ranks."""
        return self.group.all_gather(x_send, plan.rows, axis=0, kind="all_gather")[plan.order]

    def combine(self, y_recv, plan: GatherPlan):
        """y_recv (n_recv, C) -> y_send (n_send, C): every rank's rows, zeros but for this rank's experts',
        summed over the group and cut back to each sender's."""
        everyone = backend.array_module(y_recv).zeros((sum(plan.rows),) + y_recv.shape[1:], dtype=y_recv.dtype)
        everyone[plan.order] = y_recv
        return self.group.reduce_scatter(everyone, plan.rows, axis=0, kind="reduce_scatter")

    dispatch_backward = combine
    combine_backward = dispatch


DISPATCHERS = {"alltoall": ExpertDispatcher, "allgather": GatherDispatcher}
