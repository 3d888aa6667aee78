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

import numpy

from mpi_tp.core import backend
from mpi_tp.core.errors import UserError
from mpi_tp.core.params import storages
from mpi_tp.core.precision import is_half, widen
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
            return self.bucket.param_share
        return flat(self.stores[0][2][0].base)           # read now: the buckets may have moved it

    def grads(self):
        if self.bucket is not None:
            return self.bucket.grad_share
        return flat(self.stores[0][2][0].grad_base)


def flat(base):
    """A storage as one run of elements, a view: writing to it writes the parameter (or its gradient)."""
    if not base.flags.c_contiguous:
        raise UserError("a parameter's storage is laid out (out, in) for decoding (mpi_tp.core.params."
                        "store_out_in, done by mpi_tp.inference.decode.Decoder): an optimizer cannot update "
                        "it in place; train a model that no Decoder has run")
    return base.reshape(-1)


def storage_spaces(params) -> list[Space]:
    """One space per storage: every element on this rank."""
    for base, _, _ in storages(params):
        flat(base)
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
    whose members hold different elements; then the tp shards are summed (an expert's over etp) and
    replicated parameters counted once; experts (one copy per ep group) summed over ep; pipeline stages
    summed over pp.
    counted: ids of the parameters to count (a pipeline's second copy of wte is left out); None: all.
    """
    xp = backend.xp()
    squares, groups, expert = {}, {}, None      # per group: 4 float64 sums, on the device until the end
    for space in spaces:
        g, key = space.grads(), (space.group.name if space.group is not None else None)
        if key not in squares:
            squares[key], groups[key] = xp.zeros(4, dtype="float64"), space.group
        for seg in space.segments:
            if counted is not None and id(seg.members[0]) not in counted:
                continue
            replicas = seg.members[0].replicas
            if replicas is not None and replicas.rank != 0:      # a replicated key/value shard: counted once,
                continue                                         # by the first rank holding it
            shard = expert_of(seg.members[0])
            expert = shard if shard is not None else expert
            x = g[seg.lo:seg.hi]
            if is_half(x):                                      # 16-bit gradients: squared and summed in fp32
                x = widen(x)
            squares[key][(0 if seg.members[0].sharded else 1) + (2 if shard is not None else 0)] += x @ x
    keys = list(squares)
    # one copy to the host for the whole model (a sync per storage would stall a GPU's queue each time);
    # the reductions below then run on host buffers
    host = backend.asnumpy(xp.stack([squares[k] for k in keys])) if keys else numpy.zeros((0, 4))
    total = numpy.zeros(4)
    for key, part in zip(keys, host):
        if groups[key] is not None:                     # bucket shares: every member's elements
            part = groups[key].all_reduce(numpy.ascontiguousarray(part), kind="grad_norm")
        total += part
    if expert is None:
        buf = numpy.array([total[0]])
        tp.all_reduce(buf)                              # one scalar all-reduce per step
        norm_sq = float(buf[0]) + float(total[1])
    else:
        if expert.etp is tp:
            buf = numpy.array([total[0], total[2]])
            tp.all_reduce(buf)                          # dense shards and expert shards over tp
        else:                                           # expert shards over their own etp group
            buf = numpy.array([tp.all_reduce(numpy.array([total[0]]))[0],
                               expert.etp.all_reduce(numpy.array([total[2]]))[0]])
        experts = numpy.array([buf[1] + total[3]])
        expert.ep.all_reduce(experts)                   # every expert, over the ranks holding them
        norm_sq = float(buf[0]) + float(total[1]) + float(experts[0])
    if pp is not None and pp.size > 1:
        norm_sq = float(pp.all_reduce(numpy.array([norm_sq]))[0])
    return math.sqrt(norm_sq)
