"""Which attention heads each tensor-parallel rank holds, with grouped-query attention (GQA).

Legend (docs/notation.md): H query heads, H_kv key/value heads (H_kv divides H), R = H / H_kv query
heads per key/value head (query head h reads key/value head h // R), T tensor-parallel ranks (T <= H).
A rank's query heads are whole groups, or part of one group, so it needs the keys and values
of its own groups only:

  H_kv >= T: the key/value heads are divided among the ranks (split_sizes: shares differ by at
             most one), and each rank holds the R query heads of each of its key/value heads.
                 H = 8, H_kv = 4, T = 2:  rank 0  kv 0 1  q 0-3     rank 1  kv 2 3  q 4-7
                 H = 6, H_kv = 3, T = 2:  rank 0  kv 0 1  q 0-3     rank 1  kv 2    q 4-5
             H_kv = H (plain multi-head attention) is the GPT-2 split: heads divided evenly.
  H_kv < T:  the ranks are divided among the key/value heads (split_sizes(T, H_kv) consecutive ranks
             per head), and a head's R query heads among its ranks (split_sizes again); every rank
             holds the one key/value head its query heads read, a replica of it (as Megatron-LM and
             vLLM replicate them). Each replica's gradient is its own query heads' part: the
             replicas of a head sum theirs after the backward pass (Param.replicas,
             mpi_tp.parallel.finalize), so they make the same update and stay equal bit for bit.
                 H = 4, H_kv = 1, T = 3:  rank 0  kv 0  q 0-1   rank 1  kv 0  q 2   rank 2  kv 0  q 3
                 H = 4, H_kv = 2, T = 3:  rank 0  kv 0  q 0     rank 1  kv 0  q 1   rank 2  kv 1  q 2-3

Either way T <= H is all it takes (ceil(T / H_kv) ranks per head never exceed R when T <= H).
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi_tp.parallel.topology import offsets, split_sizes


@dataclass(frozen=True)
class HeadLayout:
    """Every rank's heads: q[r] its query heads, kv[r] its key/value heads (ranges of global indices)."""

    H: int
    H_kv: int
    T: int
    q: tuple        # (range, ...) per rank
    kv: tuple       # (range, ...) per rank

    @property
    def replicated(self) -> bool:
        """Whether some key/value head is held by several ranks (H_kv < T)."""
        return self.H_kv < self.T

    def replicas(self, rank: int) -> list[int]:
        """The ranks holding the same key/value heads as `rank` (itself included)."""
        return [r for r in range(self.T) if self.kv[r] == self.kv[rank]]

    def describe(self, rank: int) -> str:
        """One line: rank's query and key/value heads, and whether the latter are replicas."""
        q, kv = self.q[rank], self.kv[rank]
        span = lambda r: f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"
        others = [str(r) for r in self.replicas(rank) if r != rank]
        held = (f"a replica, also on rank{'s' if len(others) > 1 else ''} {', '.join(others)}" if others
                else "its own")
        plural = lambda r: "s" if len(r) > 1 else ""
        return (f"rank {rank}: query head{plural(q)} {span(q)}, key/value head{plural(kv)} {span(kv)} "
                f"({held})")


def head_layout(H: int, H_kv: int, T: int) -> HeadLayout:
    """The split of H query and H_kv key/value heads over T ranks (the module docstring's rule)."""
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"n_kv_head = {H_kv} must divide n_head = {H}")
    if T > H:
        raise ValueError(f"{T} tensor-parallel ranks exceed n_head = {H}: some rank would hold no query head")
    R = H // H_kv
    if H_kv >= T:
        sizes = split_sizes(H_kv, T)
        kv = [range(o, o + n) for o, n in zip(offsets(sizes), sizes)]
        q = [range(r.start * R, r.stop * R) for r in kv]
    else:
        per_head = split_sizes(T, H_kv)                # ranks holding each key/value head
        q, kv = [], []
        for head, n in enumerate(per_head):
            shares = split_sizes(R, n)                 # n <= R because T <= H
            for o, s in zip(offsets(shares), shares):
                q.append(range(head * R + o, head * R + o + s))
                kv.append(range(head, head + 1))
    return HeadLayout(H, H_kv, T, tuple(q), tuple(kv))
