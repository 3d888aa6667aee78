"""What the optimizer updates on this rank and keeps state for: whole storages, or this rank's bucket shares.

Without the distributed optimizer a rank updates every element of its
parameters: one `Space` per storage (a parameter's array, or several fused
ones, mpi_tp.core.params.storages). With it (--zero 1, Rajbhandari et al.
2020's stage 1 as Megatron-LM's distributed optimizer does it), the parameters
and gradients sit in the data-parallel buckets' flat buffers
(mpi_tp.parallel.data_parallel), and rank r of the D replicas updates only its
share of each bucket, [r n / D, (r+1) n / D) of its n elements (uneven shares
differ by one): the reduce-scatter delivered exactly those gradients, AdamW
keeps m and v for those elements only (1/D of the state), and the updated
values are all-gathered. Expert buckets are shared out over edp instead of dp.

A space's elements are cut into `segments`, runs that belong to one storage,
so that each run has one weight-decay flag and one place in the gradient
norm's accounting (sharded over tp or replicated, expert or dense). Every
element has one owner and gets the same arithmetic as without ZeRO, so the
numbers are identical.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpi_tp.core import backend
from mpi_tp.core.params import storages
from mpi_tp.parallel.expert_parallel import expert_of


@dataclass
class Segment:
    """Elements [lo, hi) of a space, all from one storage (whose params are `members`)."""

    lo: int
    hi: int
    members: list

    @property
    def decay(self) -> bool:
        return self.members[0].decay


class Space:
    """A flat run of elements that this rank updates: `params()` and `grads()` (same length), its segments,
    and, for the checkpoint, where each storage sits in the whole (`stores`: [(offset, base, members)],
    `shares`: every group member's count, `share`: this rank's slice, `group`: None when whole here)."""

    def __init__(self, stores, segments, group=None, shares=None, share=None, bucket=None, index=None):
        self.stores, self.segments, self.group, self.bucket, self.index = stores, segments, group, bucket, index
        n = sum(base.size for _, base, _ in stores)
        self.shares = [n] if shares is None else shares
        self.share = slice(0, n) if share is None else share

    @property
    def size(self) -> int:
        return self.share.stop - self.share.start

    def params(self):
        if self.bucket is not None:
            return self.bucket.params[self.share]
        return self.stores[0][2][0].base.reshape(-1)     # read now: the buckets may have moved it

    def grads(self):
        if self.bucket is not None:
            return self.bucket.grad_share
        return self.stores[0][2][0].grad_base.reshape(-1)


def storage_spaces(params) -> list[Space]:
    """One space per storage: every element on this rank."""
    return [Space([(0, base, members)], [Segment(0, base.size, members)]) for base, _, members in storages(params)]


def bucket_spaces(reducer) -> list[Space]:
    """The distributed optimizer's spaces: this rank's share of each of the reducer's buckets."""
    spaces = []
    for k, b in enumerate(reducer.buckets):
        lo, hi = b.share.start, b.share.stop
        segments = [Segment(max(at, lo) - lo, min(at + base.size, hi) - lo, members)
                    for at, base, members in b.stores if at < hi and at + base.size > lo]
        group = b.group if b.group.size > 1 else None
        spaces.append(Space(b.stores, segments, group, b.shares, b.share, bucket=b, index=k))
    return spaces


def gather_whole(space: Space, share):
    """A space's whole flat state from every group member's share (the share itself when whole here)."""
    if space.group is None:
        return share
    full = backend.xp().empty(sum(space.shares), share.dtype)
    full[space.share] = share
    return space.group.all_gather_inplace(full, space.shares)


def grad_norm(spaces: list[Space], tp, pp=None, counted=None) -> float:
    """The L2 norm of the whole model's gradient from what each rank holds, the same on every rank.

    Squares by kind: [dense sharded over tp, dense replicated, expert sharded, expert replicated].
    Bucket shares (distributed optimizer) are first summed over their group (dp, or edp for experts),
    whose members hold different elements; then the tp shards are summed and replicated parameters
    counted once; experts (one copy per ep group) summed over ep; pipeline stages summed over pp.
    counted: ids of the parameters to count (a pipeline's second copy of wte is left out); None: all.
    """
    xp = backend.xp()
    sums, groups, ep = {}, {}, None
    for space in spaces:
        g, key = space.grads(), (space.group.name if space.group is not None else None)
        part = sums.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        groups[key] = space.group
        for seg in space.segments:
            if counted is not None and id(seg.members[0]) not in counted:
                continue
            shard = expert_of(seg.members[0])
            ep = shard.ep if shard is not None else ep
            x = g[seg.lo:seg.hi]
            part[(0 if seg.members[0].sharded else 1) + (2 if shard is not None else 0)] += float(x @ x)
    total = [0.0, 0.0, 0.0, 0.0]
    for key, part in sums.items():
        if groups[key] is not None:                     # bucket shares: every member's elements
            buf = xp.asarray(part, dtype="float64")
            groups[key].all_reduce(buf, kind="grad_norm")
            part = [float(v) for v in buf]
        total = [a + b for a, b in zip(total, part)]
    if ep is None:
        buf = xp.asarray([total[0]], dtype="float64")
        tp.all_reduce(buf)                              # one scalar all-reduce per step
        norm_sq = float(buf[0]) + total[1]
    else:
        buf = xp.asarray([total[0], total[2]], dtype="float64")
        tp.all_reduce(buf)                              # dense and expert shards over tp
        experts = xp.asarray([float(buf[1]) + total[3]], dtype="float64")
        ep.all_reduce(experts)                          # every expert, over the ranks holding them
        norm_sq = float(buf[0]) + total[1] + float(experts[0])
    if pp is not None and pp.size > 1:
        buf = xp.asarray([norm_sq], dtype="float64")
        norm_sq = float(pp.all_reduce(buf)[0])
    return math.sqrt(norm_sq)
