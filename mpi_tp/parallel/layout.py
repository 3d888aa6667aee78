"""The layout: how many ranks each parallel dimension takes, and the rules they must keep. Written once.

    lay = Layout.resolve(world=8, tp=0, pp=2, dp=2)      # tp = 0: the rest of the world, here 2
    lay.describe()                                       # 'tp2 pp2 dp2': the words every command prints
    Topology.create(comm, layout=lay)                    # the communicators (mpi_tp.parallel.topology)

A layout is frozen: the training config resolves one (mpi_tp.training.config), the
topology builds its groups from it, the planner prices many (mpi_tp.planning: a Plan
is a Layout with a micro-batch size and recomputation), and the start-up line,
`mpi-tp explain` and `mpi-tp plan` print its describe(). The world-size rule is

    world size = tp x cp x pp x dp
    tp x cp x dp = etp x ep x edp           (each stage's ranks again, for the experts: Megatron's rule)

and `check` says every rule a layout breaks, in one line, the same from train,
bench and plan. No MPI here: the planner lays out machines it does not run on.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi_tp.core.errors import UserError

RULE = "world size = tp x cp x pp x dp"
DIMENSIONS = ("tp", "cp", "pp", "dp")            # the grid, innermost first (mpi_tp.parallel.topology)


class TopologyError(UserError, ValueError):
    """The requested layout does not fit the world (or a dimension cannot be split)."""


@dataclass(frozen=True)
class Layout:
    """The ranks of each dimension (tp x cp x pp x dp of them), and the options that shape the layout.

    tp: tensor-parallel size; cp: context-parallel; pp: pipeline stages; virtual: model chunks per stage
    (the interleaved schedule); dp: data-parallel replicas; ep: expert-parallel size; etp: expert tensor-
    parallel size (0: tp's), each expert's columns/rows split over etp ranks (ep x etp dividing tp x cp x dp:
    a stage's ranks laid out again for the experts, mpi_tp.parallel.expert_grid);
    sp: sequence parallelism inside tp; zero: the ZeRO stage, 0-3 (1: the optimizer state split over
    dp x cp, 2: the gradients too, 3: the parameters too; mpi_tp.parallel.buckets).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 0
    virtual: int = 1
    sp: bool = False
    zero: int = 0

    @classmethod
    def resolve(cls, world: int, tp: int = 0, cp: int = 1, pp: int = 1, dp: int = 1, **options) -> Layout:
        """The layout of a job of `world` ranks; tp = 0 (or dp = 0): what the other dimensions leave, at
        least 1. Checked: raises TopologyError with every rule it breaks (`check`)."""
        if tp == 0 or dp == 0:           # one dimension takes the rest (tp when both are free)
            rest = max(1, (tp or 1) * cp * pp * (dp or 1))
            free = max(1, world // rest)
            tp, dp = (free, dp or 1) if tp == 0 else (tp, free)
        lay = cls(tp=tp, cp=cp, pp=pp, dp=dp, **options)
        lay.check(world)
        return lay

    @property
    def ranks(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size: etp, or the dense tp when etp is 0."""
        return self.etp or self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the ranks of a stage holding the same expert shard,
        tp x cp x dp / (etp x ep)."""
        return max(1, self.tp * self.cp * self.dp // (self.expert_tp * self.ep))

    def problems(self, world: int | None = None) -> list[str]:
        """One message per rule this layout breaks (for a job of `world` ranks, when given)."""
        out = []
        small = [f"{k}={getattr(self, k)}" for k in (*DIMENSIONS, "ep", "virtual") if getattr(self, k) < 1]
        if small or self.etp < 0:
            return [f"every size must be at least 1, got {', '.join(small + ([f'etp={self.etp}'] if self.etp < 0 else []))}"]
        if world is not None and self.ranks != world:
            out.append(f"no layout of {world} ranks can be expressed: the layout {self.describe()} needs "
                       f"{self.ranks} MPI ranks but the job has {world} ({RULE}): launch with mpiexec -n "
                       f"{self.ranks}, or change --tp/--cp/--pp/--dp")
        stage = self.tp * self.cp * self.dp
        if stage % (self.ep * self.expert_tp):
            out.append(f"--ep {self.ep} x --etp {self.expert_tp} = {self.ep * self.expert_tp} must divide tp x cp x dp "
                       f"= {stage}: a stage's ranks are laid out again as etp x ep x edp for the experts")
        if self.zero not in (0, 1, 2, 3):
            out.append(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        return out

    def check(self, world: int | None = None) -> Layout:
        """Raise TopologyError naming every rule broken (one line); returns the layout when it holds."""
        wrong = self.problems(world)
        if wrong:
            raise TopologyError("; ".join(wrong))
        return self

    def words(self) -> list[str]:
        """The grid in words, 'tp2 cp2 pp2 dp4 ep2 etp1' (cp and ep only when > 1, etp when not tp's)."""
        return [f"{k}{getattr(self, k)}" for k in ("tp", "cp", "pp", "dp", "ep")
                if k not in ("cp", "ep") or getattr(self, k) > 1] + \
            ([f"etp{self.etp}"] if self.etp and self.etp != self.tp else [])

    def flags(self) -> list[str]:
        """The options in words: 'v2 +sp +zero1' (each only when on)."""
        return ([f"v{self.virtual}"] if self.virtual > 1 else []) + (["+sp"] if self.sp else []) + \
            ([f"+zero{self.zero}"] if self.zero else [])

    def describe(self) -> str:
        """'tp2 pp2 dp1 v2 +sp': what the start-up line, explain and plan print."""
        return " ".join(self.words() + self.flags())

    def to_dict(self) -> dict:
        """The grid as a checkpoint records it: {'world', 'tp', 'pp', 'dp'} (+ 'ep', 'cp' when > 1)."""
        out = {"world": self.ranks, "tp": self.tp, "pp": self.pp, "dp": self.dp}
        out.update({k: getattr(self, k) for k in ("ep", "cp") if getattr(self, k) > 1})
        if self.etp and self.etp != self.tp:
            out["etp"] = self.etp
        return out
