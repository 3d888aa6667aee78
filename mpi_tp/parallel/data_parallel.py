"""Data parallelism: gradient buckets, completed and averaged over the replicas during the backward pass.

Each of the D replicas (one per position in the data-parallel group, see
Topology) holds the same shards and computes gradients on its own part of the
global batch; the mean of their gradients is the gradient of the global batch.

The gradients live in a few contiguous buckets (every parameter's gradient is a
view into one), so that a bucket is one collective with no packing. Buckets
are cut at block boundaries, last block first: as soon as the backward pass of
the step's last micro-batch has finished every block of a bucket
(`block_done`), the bucket is made final and its collective starts, while the
earlier blocks compute (Megatron's and PyTorch DDP's overlap). The embedding
tables and the final LayerNorm, final only when the backward pass ends, form
the last bucket, started by `finish`. Per bucket and step:

  1. sequence parallelism: the gradients of the replicated parameters that act
     on each position (Param.sp_partial, kept together at the bucket's end) are
     this rank's positions' part: one all-reduce over tp sums them
     (`tp/sp_grad_all_reduce`), whatever the number of micro-batches; likewise
     the replicated key/value heads of grouped-query attention (Param.replicas,
     kept together before them), over the ranks holding them (`kv/kv_grad_all_reduce`);
  2. over the replicas, either an all-reduce (`dp/iall_reduce`), or, for the
     distributed optimizer (`distributed=True`, --zero 1), a reduce-scatter into
     this rank's share of the bucket (`dp/reduce_scatter`): rank r of D keeps
     the averaged gradient of elements [r n / D, (r+1) n / D) only, which its
     optimizer updates (mpi_tp.training.optimizer_state); the parameters, also
     kept in one flat buffer per bucket, are then all-gathered (`gather_params`,
     `dp/all_gather`). A reduce-scatter and an all-gather move what one
     all-reduce moves (docs/costmodel.md) when gradients and parameters have
     one width, so ZeRO-1 costs no extra traffic (fp32 gradients of a 16-bit
     model: less, the all-gather carrying 2 bytes a value).

Without a spare core, MPI progresses a non-blocking collective only when the
process calls into MPI; `block_done` therefore also tests the outstanding
requests. `overlap=False` starts every bucket after the backward pass, for
comparison. `hierarchical=True` all-reduces each bucket node by node
(mpi_tp.parallel.hierarchical), after the backward pass (with the distributed
optimizer each rank then keeps its share: correct, but 1.5x the traffic).

Mixture of experts: an expert's parameters (marked by MoEMLP, see
mpi_tp.parallel.expert_parallel) exist only on the replicas holding that
expert, `edp` (D / ep of them), so they go into buckets of their own, summed
over edp instead of dp. Each copy of an expert has already received the tokens
of its ep replicas (the all-to-all), so its gradient is the sum of ep replicas'
shares: summed over edp it covers all D of them, and is divided by D like
every other bucket. Dense and expert buckets are cut independently, so every
member of a group cuts its buckets alike even when the experts are divided
unevenly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy
from mpi4py import MPI

from mpi_tp.core import backend
from mpi_tp.core.failpoints import planted
from mpi_tp.core.params import storages
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.expert_parallel import expert_of
from mpi_tp.parallel.grad_release import ChunkGrads, GradRelease
from mpi_tp.parallel.hierarchical import HierarchicalAllReduce
from mpi_tp.parallel.topology import offsets, split_sizes


@dataclass(eq=False)
class Bucket:
    """n gradients (and, for the distributed optimizer, the n parameter values) in one flat buffer."""

    grads: object                    # (n,) every member's grad_base is a view into it
    stores: list                     # [(offset, base, members)]: the storages it holds, in buffer order
    blocks: frozenset                # the blocks whose gradients it holds (empty: embeddings, ln_f)
    ready_after: int | None          # the block whose backward completes it (None: the end of the pass)
    group: Group                     # dp, or edp for experts
    sp: slice                        # the sp_partial gradients, summed over tp (empty: none)
    replicas: slice                  # replicated key/value shards' gradients (Param.replicas), summed over
    replica_group: Group | None      # ... this group, the ranks holding the same heads (empty slice: none)
    params: object                   # (n,) the distributed optimizer's parameter buffer (data are views), or None
    shares: list                     # every group member's share of the n elements ([n] without it)
    share: slice                     # this rank's share
    grad_share: object               # (share,) distributed optimizer: this rank's averaged gradients, or None


def _make_bucket(stores, ready_after, blocks, group: Group, distributed: bool) -> Bucket:
    """One flat gradient buffer (and parameter buffer) for these storages; their Params become views."""
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
            base = pview
        if members[0].sp_partial:
            sp_at = min(sp_at, at)
        if members[0].replicas is not None:
            if rep_group not in (None, members[0].replicas):
                raise ValueError("a bucket's replicated shards belong to two replica groups")
            rep_group, rep_at, rep_stop = members[0].replicas, min(rep_at, at), at + base.size
        placed.append((at, base, members))
        at += base.size
    shares = split_sizes(n, group.size) if distributed else [n]
    lo = offsets(shares)[group.rank] if distributed else 0
    share = slice(lo, lo + shares[group.rank if distributed else 0])
    grad_share = xp.empty(share.stop - share.start, grads.dtype) if distributed else None
    return Bucket(grads, placed, frozenset(blocks), ready_after, group, slice(sp_at, n),
                  slice(rep_at, rep_stop), rep_group, params, shares, share, grad_share)


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


def make_buckets(model, group: Group, bucket_mb: float, distributed: bool) -> list[Bucket]:
    """model's parameters in buckets of about bucket_mb MiB, cut at block boundaries, last block first."""
    owner = {}                       # which block each storage belongs to (None: embeddings, ln_f)
    for i, block in enumerate(model.h):
        for p in block.parameters():
            owner[id(p.base)] = i
    stores = storages(model.parameters())
    experts = {id(p.base): expert_of(p) for p in model.parameters() if expert_of(p) is not None}
    kinds = [([s for s in stores if id(s[0]) not in experts], group)]        # (storages, their group)
    if experts:
        kinds.append(([s for s in stores if id(s[0]) in experts], next(iter(experts.values())).edp))
    buckets, limit = [], bucket_mb * 2**20
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
                buckets.append(_make_bucket(current[k], i, blocks, g, distributed))
                current[k], size[k] = [], 0
    rest = [s for s in kinds[0][0] if id(s[0]) not in owner]
    if rest:
        buckets.append(_make_bucket(rest, None, set(), group, distributed))
    return buckets


class GradReducer:
    """Completes and averages the gradients over `group` (the data-parallel group; experts over edp),
    bucket by bucket; hook it into GPT.backward and call finish() after the last backward
    (mpi_tp.parallel.finalize.finalize_grads does).

    distributed: the distributed optimizer's reduce-scatter instead of the all-reduce (ZeRO-1).
    release: with it, each bucket's whole gradient buffer dropped once reduce-scattered and made again
    at the next backward (ZeRO-2, mpi_tp.parallel.grad_release): GPT.backward calls grads(offset).need.
    """

    def __init__(self, model, group: Group, bucket_mb: float = 8.0, overlap: bool = True,
                 hierarchical: bool = False, distributed: bool = False, release: bool = False):
        self.group, self.overlap = group, overlap and not hierarchical
        self.distributed = distributed and group.size > 1
        if release and hierarchical:
            raise ValueError("ZeRO-2's gradient release runs with the flat reduce-scatter, not --hierarchical-dp")
        self.tp = model.topo.tp
        self._done, self._started, self._pending, self._gathers = set(), set(), [], []
        tp_sums = self.tp.size > 1 and any(p.sp_partial or p.replicas is not None for p in model.parameters())
        self.buckets = make_buckets(model, group, bucket_mb, self.distributed) if group.size > 1 or tp_sums else []
        self.grad_dtype = self.buckets[0].grads.dtype if self.buckets else None    # what the reductions carry
        self.release = GradRelease(self.buckets) if release and self.distributed else None
        self.hierarchical = {}       # group name -> HierarchicalAllReduce
        if hierarchical and group.size > 1:
            for g in {b.group.name: b.group for b in self.buckets if b.group.size > 1}.values():
                self.hierarchical[g.name] = HierarchicalAllReduce(g)

    def _start(self, k: int) -> None:
        """Bucket k is final on this rank: sum its sp_partial part over tp, start its collective over the group."""
        b = self.buckets[k]
        self._started.add(k)
        if b.sp.start < b.sp.stop and not planted("bug-sp-grads"):
            self.tp.all_reduce(b.grads[b.sp], kind="sp_grad_all_reduce")
        if b.replicas.start < b.replicas.stop:
            b.replica_group.all_reduce(b.grads[b.replicas], kind="kv_grad_all_reduce")
        if self.group.size == 1 or self.hierarchical:     # hierarchical: node by node, blocking, in finish()
            return
        if self.distributed and b.group.size == 1:        # experts held by one replica (ep = D): nothing to sum
            b.grad_share[...] = b.grads
            pending = None
        elif self.distributed:
            pending = b.group.ireduce_scatter(b.grads, b.shares, axis=0, out=b.grad_share)
        else:
            pending = b.group.iall_reduce(b.grads)
        self._pending.append((k, pending))

    def block_done(self, i: int) -> None:
        """Called by the backward pass once block i's gradients are final: start the buckets whose
        blocks are all done now (in bucket order, the same on every replica)."""
        if not self.overlap:
            return
        self._done.add(i)
        for k, b in enumerate(self.buckets):
            if k not in self._started and b.blocks and b.blocks <= self._done:
                self._start(k)
        for k, pending in self._pending:
            if pending is not None and pending.test() and self.release is not None:    # (drives MPI's progress)
                self.release.drop(k)                                    # ZeRO-2: the share has it all

    def grads(self, offset: int = 0):
        """What GPT.backward calls need(i) on before block i's backward (ZeRO-2), or None (ZeRO-0/1)."""
        return None if self.release is None else ChunkGrads(self.release, offset)

    def chunk(self, offset: int) -> "ChunkReducer":
        """What one pipeline chunk's GPT.backward takes as its reducer: its block i is block
        offset + i of the model given here (the stage); finishing is left to the stage."""
        return ChunkReducer(self, offset)

    def finish(self) -> None:
        """After the backward pass: start what is left, wait for everything, divide by D."""
        for k in range(len(self.buckets)):
            if k not in self._started:
                self._start(k)
        scale = 1.0 / self.group.size
        if self.hierarchical and self.group.size > 1:
            for b in self.buckets:
                if b.group.size > 1:
                    self.hierarchical[b.group.name].all_reduce(b.grads)
                b.grads *= scale
                if self.distributed:
                    b.grad_share[...] = b.grads[b.share]
        for k, pending in self._pending:
            if pending is not None:
                pending.wait()
            b = self.buckets[k]
            (b.grad_share if self.distributed else b.grads)[...] *= scale   # experts too: edp sums hold all D
            if self.release is not None and b.grads is not None:
                self.release.drop(k)                                        # ZeRO-2
        self._pending, self._done, self._started = [], set(), set()

    def gather_params(self, k: int) -> None:
        """Distributed optimizer: bucket k's share is updated; start all-gathering its parameters."""
        b = self.buckets[k]
        if b.group.size > 1:
            self._gathers.append(b.group.iall_gather_inplace(b.params, b.shares))

    def wait_params(self) -> None:
        """Every parameter all-gathered (after the optimizer's step)."""
        for pending in self._gathers:
            pending.wait()
        self._gathers = []


class ChunkReducer:
    """GradReducer.chunk(offset): block_done(i) reports block offset + i; finish() does nothing."""

    def __init__(self, reducer: GradReducer, offset: int):
        self.reducer, self.offset = reducer, offset

    def block_done(self, i: int) -> None:
        self.reducer.block_done(self.offset + i)

    def finish(self) -> None:
        """Nothing: finalize_grads calls GradReducer.finish() after the schedule."""
