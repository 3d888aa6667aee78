"""The experts' own grid: a pipeline stage's tp x cp x dp ranks laid out again as etp x ep x edp.

Megatron-LM's rule (its "MoE parallel folding"): the dense layers of a stage split its D = tp x cp x dp
ranks one way, the experts another, with D = etp x ep x edp:

    etp  expert tensor parallelism: each expert's columns and rows split over etp ranks (consecutive)
    ep   expert parallelism: the experts divided among ep groups of etp ranks
    edp  expert data parallelism: the D / (etp ep) ranks holding the same expert shard, over which its
         gradient is summed (Megatron-LM #1628: with ep = 1 and etp != tp the sum ran over the wrong ranks)

A rank's place d in its stage counts tp fastest, then cp, then dp (the dense grid's order), and the
experts read the same d with etp fastest, then ep, then edp:

    d = (dp_r cp + cp_r) tp + tp_r = (edp_r ep + ep_r) etp + etp_r

    tp 2, dp 2, ep 2, etp 1:        d:   0     1     2     3        (world ranks 0 1 2 3)
                                  dense: tp0   tp1   tp0   tp1      dp0 dp0 dp1 dp1
                                experts: ep0   ep1   ep0   ep1      edp0 edp0 edp1 edp1

With etp = tp (the default) the etp group is the tp group and, without cp, the ep groups are ep
consecutive data-parallel replicas at one tp coordinate: the placement of Megatron's and DeepSpeed's
first expert parallelism. Which tokens each rank routes and how they reach an expert's etp group is
mpi_tp.model.moe's (each rank routes its own positions; an etp group gathers its members' rows).
No MPI but the splits: the planner reads the same rule from Layout.
"""
from __future__ import annotations

from mpi4py import MPI

from mpi_tp.parallel.collectives import Group


def expert_coords(world_rank: int, layout) -> tuple[int, int, int, int]:
    """(pp_r, edp_r, ep_r, etp_r) of a world rank: its stage and its place in the experts' grid."""
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    tp_r, cp_r = world_rank % tp, (world_rank // tp) % cp
    pp_r, dp_r = (world_rank // (tp * cp)) % pp, world_rank // (tp * cp * pp)
    d = (dp_r * cp + cp_r) * tp + tp_r                        # the rank's place in its stage
    etp, ep = layout.expert_tp, layout.ep
    return pp_r, d // (etp * ep), (d // etp) % ep, d % etp


def expert_groups(comm: MPI.Comm, layout, stats, tp: Group, dpcp: Group) -> tuple[Group, Group, Group]:
    """(ep, etp, edp) Groups of this rank (collective over comm, the world). Where a group is one the dense
    grid has already (etp = tp's; one rank; edp = dp x cp's when ep = 1 and etp = tp) it is reused, not made
    again: an MPI process has a few thousand communicators."""
    pp_r, edp_r, ep_r, etp_r = expert_coords(comm.Get_rank(), layout)
    same_tp = layout.expert_tp == layout.tp
    ep_n, etp_n, edp_n = layout.ep, layout.expert_tp, layout.edp

    def split(color, key, name, size):
        if size == 1:
            return Group(MPI.COMM_SELF, name, stats)
        return Group(comm.Split(color, key=key), name, stats)

    etp = tp if same_tp else split((pp_r * edp_n + edp_r) * ep_n + ep_r, etp_r, "etp", etp_n)
    ep = split((pp_r * edp_n + edp_r) * etp_n + etp_r, ep_r, "ep", ep_n)
    if same_tp and ep_n == 1:
        edp = dpcp                                   # the dense gradient's group: no new communicator
    else:
        edp = split((pp_r * ep_n + ep_r) * etp_n + etp_r, edp_r, "edp", edp_n)
    return ep, etp, edp
