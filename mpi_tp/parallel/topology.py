"""Who holds what: the process grid and the rule that cuts a dimension into shards.

The world is laid out as a Cartesian grid of shape (dp, pp, cp, tp): tensor-parallel
groups are consecutive ranks (ranks 0..tp-1 form the first group), so they sit
on one node when ranks are placed by node, which is where tensor parallelism's
frequent all-reduces belong; context-parallel groups come next (their ring
passes every layer's keys and values, forward and backward: the next-heaviest
traffic, so the next-nearest ranks, as in Megatron's tp-cp-...-dp-pp order),
then pipeline stages (one activation per micro-batch between neighbours), and
data-parallel replicas outermost (one gradient reduction per step). Layers
only ever see `topo.tp` (and attention `topo.cp`), so adding a dimension does
not touch them.

    topo = Topology.create(MPI.COMM_WORLD, tp=2)      # dp = world size / tp
    topo.tp.rank, topo.tp.size                        # this rank's place in its TP group
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mpi4py import MPI

from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.comm_stats import CommStats
from mpi_tp.parallel.expert_grid import expert_groups
from mpi_tp.parallel.layout import Layout, TopologyError


def split_sizes(n: int, parts: int) -> list[int]:
    """Cut n units into `parts` shards that differ by at most one unit.

    The first n % parts shards get the extra unit: split_sizes(5, 2) == [3, 2].
    """
    if parts < 1:
        raise TopologyError(f"cannot split into {parts} parts")
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def offsets(sizes: list[int]) -> list[int]:
    """Start of each shard: offsets([3, 2]) == [0, 3]."""
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


def check_splittable(n: int, parts: int, what: str) -> None:
    """Refuse a split that would leave some rank an empty shard, with a message that says what to do."""
    if n < parts:
        raise TopologyError(
            f"{what} = {n} cannot be split over {parts} tensor-parallel ranks: some rank would "
            f"hold nothing; use a tensor-parallel size of at most {n}"
        )


def shard_range(n: int, group, sizes, what: str):
    """(sizes, start, stop): every rank's share of a dimension of n units (given, or the rule above) and
    this rank's range [start, stop) of it."""
    if sizes is None:
        check_splittable(n, group.size, what)
        sizes = split_sizes(n, group.size)
    if len(sizes) != group.size or sum(sizes) != n or min(sizes) < 1:
        raise ValueError(f"{what}: shard sizes {sizes} do not cut {n} units over {group.size} ranks")
    start = offsets(sizes)[group.rank]
    return list(sizes), start, start + sizes[group.rank]


@dataclass
class Topology:
    """The process grid and its communicator groups.

    world: every rank of the job.  tp: this rank's tensor-parallel group.
    pp: its pipeline group (the stages of one model replica; size 1 without a pipeline).
    dp: its data-parallel group (size 1 until data parallelism is used).
    ep: its expert-parallel group, among which the experts of a mixture-of-experts layer are split
        (tokens travel between them by all-to-all); etp: its expert tensor-parallel group, over which
        each expert's columns and rows are split (the tp group unless Layout.etp says otherwise);
        edp: its expert-data-parallel group, the ranks of its stage holding the same expert shards,
        over which their gradients are summed. A stage's tp x cp x dp ranks laid out again as
        etp x ep x edp (mpi_tp.parallel.expert_grid); with etp = tp and no cp, ep consecutive
        members of dp, and edp the dp / ep replicas holding the same experts (dp itself when ep = 1).
    stats: the collective counters shared by all groups.
    """

    world: MPI.Comm
    tp: Group
    pp: Group
    dp: Group
    ep: Group
    edp: Group
    stats: CommStats
    subgroups: dict = field(default_factory=dict)     # tp_subgroup's groups, made once each
    cp: Group | None = None     # its context-parallel group (size 1 without context parallelism)
    dpcp: Group | None = None   # the ranks holding the same weights: dp x cp (the gradient reducer's group)
    layout: Layout | None = None    # the sizes it was made from (mpi_tp.parallel.layout)
    etp: Group | None = None        # its expert tensor-parallel group (tp's when None)

    def __post_init__(self):
        if self.cp is None:
            self.cp, self.dpcp = Group(MPI.COMM_SELF, "cp", self.stats), self.dp
        if self.etp is None:
            self.etp = self.tp
        if self.layout is None:
            self.layout = Layout(tp=self.tp.size, cp=self.cp.size, pp=self.pp.size, dp=self.dp.size, ep=self.ep.size,
                                 etp=self.etp.size)

    @classmethod
    def create(cls, comm: MPI.Comm | None = None, tp: int | None = None, dp: int = 1, pp: int = 1,
               ep: int = 1, cp: int = 1, *, etp: int = 0, layout: Layout | None = None) -> "Topology":
        """The communicators of `layout` (default: Layout.resolve of the sizes given; tp None: the rest of
        the world). world = dp x pp x cp x tp ranks: tensor-parallel groups are consecutive ranks (inside a
        node), context-parallel groups next, then pipeline stages, data-parallel replicas outermost
        (Narayanan et al.'s PTD-P order with cp inside it; see the module docstring).
        ep (dividing dp): the data-parallel group is cut into expert-parallel groups of ep
        consecutive members (Megatron's and DeepSpeed's placement: experts split where the
        dense model is replicated)."""
        comm = MPI.COMM_WORLD if comm is None else comm
        n = comm.Get_size()
        if layout is None:
            layout = Layout.resolve(n, tp=tp or 0, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp)
        else:
            layout.check(n)
        tp, cp, pp, dp = layout.tp, layout.cp, layout.pp, layout.dp
        stats = CommStats()
        # Rank order is kept (reorder=False) so that tp groups are consecutive world ranks.
        cart = comm.Create_cart(dims=[dp, pp, cp, tp], periods=[False] * 4, reorder=False)
        tp_comm = cart.Sub([False, False, False, True])
        pp_comm = cart.Sub([False, True, False, False])
        dp_comm = cart.Sub([True, False, False, False])
        cp_group = dpcp_group = None
        if cp > 1:
            cp_group = Group(cart.Sub([False, False, True, False]), "cp", stats)
            dpcp_group = Group(cart.Sub([True, False, True, False]), "dpcp", stats)
        cart.Free()
        tp_group, dp_group = Group(tp_comm, "tp", stats), Group(dp_comm, "dp", stats)
        ep_group, etp_group, edp_group = expert_groups(comm, layout, stats, tp_group,
                                                       dp_group if dpcp_group is None else dpcp_group)
        return cls(world=comm, tp=tp_group, pp=Group(pp_comm, "pp", stats), dp=dp_group, ep=ep_group,
                   edp=edp_group, stats=stats, cp=cp_group, dpcp=dpcp_group, layout=layout, etp=etp_group)

    @classmethod
    def serial(cls) -> "Topology":
        """A one-rank layout (tp = pp = dp = 1) on COMM_SELF: the serial reference model."""
        return cls.create(MPI.COMM_SELF, tp=1, dp=1)

    def tp_subgroup(self, name: str, colors: list[int]) -> Group:
        """The tensor-parallel ranks whose color equals this rank's (colors: one per tp rank, the same list
        on every rank), as a Group: e.g. the ranks holding replicas of one key/value head (mpi_tp.model.heads).
        Made on first use (collective over tp) and freed with the layout; COMM_SELF when tp = 1."""
        key = (name, tuple(colors))
        if key not in self.subgroups:
            if self.tp.size == 1:
                self.subgroups[key] = Group(MPI.COMM_SELF, name, self.stats)
            else:
                sub = self.tp.comm.Split(colors[self.tp.rank], key=self.tp.rank)
                self.subgroups[key] = Group(sub, name, self.stats)
        return self.subgroups[key]

    def replica_rows(self, per_replica: int) -> slice:
        """This rank's rows of a global batch of dp x per_replica sequences: its data-parallel replica's
        (replica r holds rows r * per_replica .. (r + 1) * per_replica - 1, its micro-batches one after
        another; every rank of a replica the same rows)."""
        r = self.dp.rank
        return slice(r * per_replica, (r + 1) * per_replica)

    def free(self) -> None:
        """Release the layout's communicators (collective over its ranks); a second call does nothing."""
        groups = (self.tp, self.pp, self.dp, self.ep, self.etp, self.edp, self.cp, self.dpcp,
                  *self.subgroups.values())
        for comm in {id(g.comm): g.comm for g in groups}.values():
            if comm not in (MPI.COMM_SELF, MPI.COMM_NULL):      # mpi4py sets a freed handle to COMM_NULL
                comm.Free()
