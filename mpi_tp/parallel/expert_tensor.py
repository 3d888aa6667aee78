"""Expert tensor parallelism: each expert's MLP split column/row over its etp group (Layout.etp, Megatron-LM's
--expert-tensor-parallel-size), independently of the dense layers' tp.

Legend: C = channels, E_i = this rank's experts, R_m = the rows etp member m received for them (after the
dispatch: mpi_tp.parallel.expert_parallel), in expert order.

    member m: x_recv (R_m, C) --all-gather over etp--> (sum_m R_m, C), expert by expert, every member's rows
              each member: its columns F_m of fc (gate/up), its rows of proj (down) -> partial (sum R, C)
    member m: y_recv (R_m, C) <--all-reduce over etp, its rows-- the partial sums, each member its own rows

The members hold different tokens (every rank routes its own positions: mpi_tp.parallel.expert_tokens),
so the gather is what gives each shard the same rows. The two are each other's gradient: backward, an
all-gather of dy and the partial dx summed back (an all-reduce of which each member keeps its rows: see
scatter, why not a reduce-scatter). One count exchange (E_i integers per member) per
layer and pass sets the plan. With etp = 1 both are nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from mpi_tp.core import backend
from mpi_tp.parallel.collectives import Group


@dataclass
class EtpPlan:
    """members[m]: rows member m contributes; expert_rows[j]: gathered rows of local expert j; order: the
    gathered rows (member-major) in expert-major order (None with one member)."""

    members: list
    expert_rows: list
    order: object


class ExpertRows:
    """Gathers an etp group's rows for its experts and scatters the partial outputs back (module docstring)."""

    def __init__(self, group: Group):
        self.group = group

    def plan(self, expert_rows) -> EtpPlan:
        """expert_rows: this rank's received rows per local expert (host integers)."""
        if self.group.size == 1:
            return EtpPlan([int(sum(expert_rows))], [int(n) for n in expert_rows], None)
        mine = numpy.asarray(expert_rows, dtype=numpy.int64).reshape(1, -1)
        table = self.group.all_gather(mine, [1] * self.group.size, axis=0, kind="etp_counts")   # (etp, E_i)
        first = (numpy.cumsum(table.reshape(-1)) - table.reshape(-1)).reshape(table.shape)
        order = numpy.concatenate([numpy.arange(first[m, j], first[m, j] + table[m, j])
                                   for j in range(table.shape[1]) for m in range(table.shape[0])]
                                  + [numpy.zeros(0, numpy.int64)])
        return EtpPlan([int(n) for n in table.sum(axis=1)], [int(n) for n in table.sum(axis=0)],
                       backend.asarray(order.astype(numpy.int64)))

    def gather(self, x, plan: EtpPlan):
        """(R_m, C) -> (sum R, C): every member's rows, expert by expert."""
        if plan.order is None:
            return x
        return self.group.all_gather(x, plan.members, axis=0, kind="etp_gather")[plan.order]

    def scatter(self, y, plan: EtpPlan):
        """(sum R, C) partial sums, expert by expert -> (R_m, C): this member's rows, summed over etp.

        An all-reduce, then this member's rows: a reduce-scatter would sum a row's partials in an order that
        depends on whose block the row is in (Open MPI's ring starts each block at its owner), so a token
        decoded alone (its row in rank 0's block) and the same token in a whole sequence (in its owner's)
        would differ in the last bit at 16 bits (tests/test_precision_infer.py). Twice a reduce-scatter's
        bytes, for one answer whatever the batch."""
        if plan.order is None:
            return y
        xp = backend.array_module(y)
        by_member = xp.empty_like(y)
        by_member[plan.order] = y
        whole = self.group.all_reduce(by_member, kind="etp_reduce")
        at = sum(plan.members[:self.group.rank])
        return xp.ascontiguousarray(whole[at:at + plan.members[self.group.rank]])

    gather_backward = scatter
    scatter_backward = gather
