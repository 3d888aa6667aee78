"""The data-parallel buckets: every parameter's gradient (and, sharded, its value) a view into a flat buffer.

A bucket holds the storages of a run of blocks (cut last block first, the
backward order; the embeddings and the final norm form the last bucket), so
that one collective moves it with no packing (mpi_tp.parallel.data_parallel).
Sharded (the distributed optimizer, ZeRO, Rajbhandari et al. 2020), rank r of
the group's D ranks owns elements [r n / D, (r+1) n / D) of its n:

    zero 1   the whole flat gradients and parameters on every rank; the optimizer's state for the share
    zero 2   the same while the backward passes accumulate; the whole gradients are dropped (`drop_grads`)
             once reduce-scattered into the share, and held again (`hold_grads`) when the next step begins
    zero 3   the parameters too: `param_share` only, the whole values held (`hold_params`) from an
             all-gather while a layer runs (mpi_tp.parallel.fsdp), the gradients only while its backward runs

A storage's Params point at views of the held buffers; dropped, they point at an empty placeholder, so
that a layer using a parameter that is not held fails loudly instead of reading stale numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy
from mpi4py import MPI

from mpi_tp.core import backend
from mpi_tp.core.params import storages
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.expert_parallel import expert_of
from mpi_tp.parallel.topology import offsets, split_sizes


@dataclass(frozen=True)
class Extent:
    """Where a storage sits in a bucket needs its shape only (a bucket holds no reference to old arrays)."""

    shape: tuple

    @property
    def size(self) -> int:
        return int(numpy.prod(self.shape))


@dataclass(eq=False)
class Bucket:
    """n gradients (and, for the distributed optimizer, the n parameter values) in one flat buffer."""

    grads: object                    # (n,) every member's grad_base is a view into it (None: dropped)
    stores: list                     # [(offset, Extent, members)]: the storages it holds, in buffer order
    blocks: frozenset                # the blocks whose gradients it holds (empty: embeddings, ln_f)
    ready_after: int | None          # the block whose backward completes it (None: the end of the pass)
    group: Group                     # dp, or edp for experts
    sp: slice                        # the sp_partial gradients, summed over tp (empty: none)
    replicas: slice                  # replicated key/value shards' gradients (Param.replicas), summed over
    replica_group: Group | None      # ... this group, the ranks holding the same heads (empty slice: none)
    params: object                   # (n,) the distributed optimizer's parameter buffer (None: not held)
    shares: list                     # every group member's share of the n elements ([n] without it)
    share: slice                     # this rank's share
    grad_share: object               # (share,) distributed optimizer: this rank's averaged gradients, or None
    param_share: object              # (share,) its parameters (a view of params at zero 1 and 2), or None
    grad_dtype: object               # the gradients' dtype (fp32 gradients of a 16-bit model)

    @property
    def size(self) -> int:
        return sum(self.shares)

    def hold_grads(self) -> None:
        """Zeroed whole gradients, the members' grads views of them (nothing when held already)."""
        if self.grads is None:
            self.grads = backend.xp().zeros(self.size, self.grad_dtype)
            _point(self.stores, self.grads, "grad")

    def drop_grads(self) -> None:
        """Let the whole gradients go (the reduce-scatter has read them): the share is all that is kept."""
        if self.grads is not None:
            self.grads = None
            _point(self.stores, backend.xp().zeros(0, self.grad_dtype), "grad")

    def hold_params(self, full) -> None:
        """zero 3: full (n,), every member's values all-gathered, becomes the members' storage."""
        self.params = full
        _point(self.stores, full, "data")

    def drop_params(self) -> None:
        """zero 3: let the whole values go; the share stays."""
        if self.params is not None:
            self.params = None
            _point(self.stores, backend.xp().zeros(0, self.param_share.dtype), "data")


def _point(stores, flat, what: str) -> None:
    """Every member's data (what="data") or grad at its view of flat (n,), or at flat itself when empty."""
    for at, extent, members in stores:
        view = flat[at:at + extent.size].reshape(extent.shape) if flat.size else flat
        for p in members:
            if what == "data":
                p.base, p.data = view, (view[p.view] if flat.size else view)
            else:
                p.grad_base, p.grad = view, (view[p.view] if flat.size else view)
                p.fresh = True


def make_bucket(stores, ready_after, blocks, group: Group, distributed: bool, stage: int = 1) -> Bucket:
    """One flat gradient buffer (and parameter buffer) for these storages; their Params become views.
    stage 3 keeps the parameters' share only, and no gradient buffer (mpi_tp.parallel.fsdp holds them)."""
    xp = backend.xp()
    # replicated key/value shards, then sp_partial ones, last, each kind together
    stores = sorted(stores, key=lambda s: (s[2][0].sp_partial, s[2][0].replicas is not None))
    n = sum(base.size for base, _, _ in stores)
    grads = xp.zeros(n, dtype=stores[0][1].dtype)          # the gradients' own (fp32 grads of a 16-bit model)
    params = xp.empty(n, dtype=stores[0][0].dtype) if distributed else None
    at, sp_at, placed = 0, n, []
    rep_at, rep_stop, rep_group = n, n, None
    for base, grad, members in stores:
        view = grads[at:at + base.size].reshape(base.shape)
        view[...] = grad
        for p in members:
            p.grad_base, p.grad = view, view[p.view]
        if params is not None:
            pview = params[at:at + base.size].reshape(base.shape)
            pview[...] = base
            for p in members:
                p.base, p.data = pview, pview[p.view]
        if members[0].sp_partial:
            sp_at = min(sp_at, at)
        if members[0].replicas is not None:
            if rep_group not in (None, members[0].replicas):
                raise ValueError("a bucket's replicated shards belong to two replica groups")
            rep_group, rep_at, rep_stop = members[0].replicas, min(rep_at, at), at + base.size
        placed.append((at, Extent(base.shape), members))
        at += base.size
    shares = split_sizes(n, group.size) if distributed else [n]
    lo = offsets(shares)[group.rank] if distributed else 0
    share = slice(lo, lo + shares[group.rank if distributed else 0])
    grad_share = xp.empty(share.stop - share.start, grads.dtype) if distributed else None
    b = Bucket(grads, placed, frozenset(blocks), ready_after, group, slice(sp_at, n), slice(rep_at, rep_stop),
               rep_group, params, shares, share, grad_share, params[share] if distributed else None, grads.dtype)
    if stage == 3:                   # the share is a copy of its own: the whole buffers go
        b.param_share = b.param_share.copy()
        b.drop_params()
        b.drop_grads()
    return b


def tied_copies(model) -> set:
    """The storages (ids) of a pipeline stage's copies of the tied table wte (mpi_tp.parallel.pipeline.
    embedding_group; none for a model not cut into stages). Under ZeRO-3 their gradients are summed as shares
    (TiedEmbedding.sum_shares), which needs every copy's share cut alike: each copy is a bucket of its own."""
    tied = getattr(model, "tied_embedding", None)
    return {id(t.weight.base) for t in tied.tables} if tied is not None else set()


def _block_bytes(model, kinds, owner):
    """(blocks, kinds): each block's gradient bytes of each kind, the largest over the tensor-parallel group.
    Buckets are cut on these, so every tensor-parallel rank cuts at the same blocks, uneven shards
    notwithstanding: the collectives over tp (and over a key/value head's replicas) that start a
    bucket then pair up (cut on each rank's own sizes, they did not: a hang under sequence parallelism)."""
    sizes = numpy.zeros((len(model.h), len(kinds)), dtype=numpy.int64)
    for k, (mine, _) in enumerate(kinds):
        for store in mine:
            if owner.get(id(store[0])) is not None:
                sizes[owner[id(store[0])], k] += store[0].nbytes
    if model.topo.tp.size > 1 and sizes.size:
        model.topo.tp.all_reduce(sizes, op=MPI.MAX, kind="bucket_plan")        # once, when the buckets are made
    return sizes


def make_buckets(model, group: Group, bucket_mb: float, distributed: bool, stage: int = 1) -> list[Bucket]:
    """model's parameters in buckets of about bucket_mb MiB, cut at block boundaries, last block first
    (stage 3: one block a bucket, what one all-gather brings before the block runs)."""
    owner = {}                       # which block each storage belongs to (None: embeddings, ln_f)
    for i, block in enumerate(model.h):
        for p in block.parameters():
            owner[id(p.base)] = i
    stores = storages(model.parameters())
    experts = {id(p.base): expert_of(p) for p in model.parameters() if expert_of(p) is not None}
    kinds = [([s for s in stores if id(s[0]) not in experts], group)]        # (storages, their group)
    if experts:
        kinds.append(([s for s in stores if id(s[0]) in experts], next(iter(experts.values())).edp))
    buckets, limit = [], 0 if stage == 3 else bucket_mb * 2**20
    current, size = [[] for _ in kinds], [0] * len(kinds)
    block_bytes = _block_bytes(model, kinds, owner)
    for i in reversed(range(len(model.h))):            # backward order
        for k, (mine, g) in enumerate(kinds):          # dense, then experts: each cut on its own sizes
            for store in mine:
                if owner.get(id(store[0])) == i:
                    current[k].append(store)
            size[k] += int(block_bytes[i, k])
            if (size[k] >= limit or i == 0) and current[k]:
                blocks = {owner[id(store[0])] for store in current[k]}
                buckets.append(make_bucket(current[k], i, blocks, g, distributed, stage))
                current[k], size[k] = [], 0
    rest = [s for s in kinds[0][0] if id(s[0]) not in owner]
    if stage == 3:                   # each copy of the tied wte alone: cut alike wherever it is held
        copies = tied_copies(model)
        for store in [s for s in rest if id(s[0]) in copies]:
            buckets.append(make_bucket([store], None, set(), group, distributed, stage))
        rest = [s for s in rest if id(s[0]) not in copies]
    if rest:
        buckets.append(make_bucket(rest, None, set(), group, distributed, stage))
    return buckets
