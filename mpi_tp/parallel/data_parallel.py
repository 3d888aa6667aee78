"""Data parallelism: average the gradients over the replicas, in buckets, during the backward pass.

Each of the D replicas (one per position in the data-parallel group, see
Topology) holds the same shards and computes gradients on its own part of the
global batch; the mean of their gradients is the gradient of the global batch.

The gradients live in a few contiguous buckets (every parameter's gradient is a
view into one), so that a bucket is one `Iallreduce` with no packing. Buckets
are cut at block boundaries, last block first: as soon as the backward pass has
finished every block of a bucket (`block_done`), its all-reduce starts, and it
proceeds while the earlier blocks compute (Megatron's and PyTorch DDP's
overlap). The embedding tables and the final LayerNorm, whose gradients are
final only when the backward pass ends, form the last bucket, started by
`finish`. With gradient accumulation only the last micro-batch's backward
reports its blocks. A pipeline stage (mpi_tp.model.pipeline) reports each of
its chunks' blocks during that chunk's last backward, through `chunk(offset)`,
and finishes after the schedule: a bucket's all-reduce proceeds while the rest
of the schedule runs (the chunk's earlier blocks, the stage's other chunks).

Without a spare core, MPI progresses a non-blocking collective only when the
process calls into MPI; `block_done` therefore also tests the outstanding
requests. `overlap=False` does every all-reduce after the backward pass, for
comparison. `hierarchical=True` reduces each bucket node by node
(mpi_tp.parallel.hierarchical), after the backward pass.

Mixture of experts: an expert's parameters (marked by MoEMLP, see
mpi_tp.parallel.expert_parallel) exist only on the replicas holding that
expert, `edp` (dp / ep of them), so they go into buckets of their own, summed
over edp instead of dp. Each copy of an expert has already received the tokens
of its ep replicas (the all-to-all), so its gradient is the sum of ep replicas'
shares: summed over edp it covers all dp of them, and is divided by dp like
every other bucket (with ep = dp there is nothing to sum, only the division).
Dense and expert buckets are cut independently (each from its own sizes), so
every member of a group cuts its buckets alike even when the experts are
divided unevenly. Without experts everything is as before.
"""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.core.params import storages
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.expert_parallel import expert_of
from mpi_tp.parallel.hierarchical import HierarchicalAllReduce


class GradReducer:
    """Averages gradients over `group` (the data-parallel group; expert parameters are summed over
    their expert-data-parallel group, then divided the same); hook it into GPT.backward."""

    def __init__(self, model, group: Group, bucket_mb: float = 8.0, overlap: bool = True,
                 hierarchical: bool = False):
        self.group, self.overlap = group, overlap and not hierarchical
        self.hierarchical = HierarchicalAllReduce(group) if hierarchical and group.size > 1 else None
        self.buckets = []          # [(flat grad buffer, index of the block that completes it or None)]
        self._blocks = []          # per bucket: the indices of the blocks it holds (empty: not blocks')
        self._groups = []          # per bucket: the group that sums it (dp, or edp for experts)
        self._done, self._started = set(), set()            # this step's finished blocks, started buckets
        self._pending = []
        if group.size == 1:
            return
        # Which block each parameter storage belongs to (None: embeddings and ln_f, ready at the end).
        owner = {}
        for i, block in enumerate(model.h):
            for p in block.parameters():
                owner[id(p.base)] = i
        stores = storages(model.parameters())
        experts = {id(p.base): expert_of(p) for p in model.parameters() if expert_of(p) is not None}
        kinds = [([s for s in stores if id(s[0]) not in experts], group)]        # (storages, their group)
        edp = next(iter(experts.values())).edp if experts else None
        if edp is not None:
            kinds.append(([s for s in stores if id(s[0]) in experts], edp))
            if hierarchical:               # (ep = 1: edp is dp itself, and so is this)
                self.hierarchical_experts = self.hierarchical if edp is group else HierarchicalAllReduce(edp)
        limit = bucket_mb * 2**20
        current, size = [[] for _ in kinds], [0] * len(kinds)
        for i in reversed(range(len(model.h))):            # backward order
            for k, (mine, g) in enumerate(kinds):          # dense, then experts: each cut on its own sizes
                for store in mine:
                    if owner.get(id(store[0])) == i:
                        current[k].append(store)
                        size[k] += store[0].nbytes
                if size[k] >= limit or i == 0:
                    if current[k]:
                        self._make_bucket(current[k], i, {owner[id(store[0])] for store in current[k]}, g)
                    current[k], size[k] = [], 0
        rest = [s for s in kinds[0][0] if id(s[0]) not in owner]
        if rest:
            self._make_bucket(rest, None, set(), group)

    def _make_bucket(self, stores, ready_after, blocks: set, group: Group) -> None:
        """One flat gradient buffer for these storages; their Params' grads become views into it."""
        xp = backend.xp()
        n = sum(base.size for base, _, _ in stores)
        flat = xp.zeros(n, dtype=stores[0][0].dtype)
        at = 0
        for base, grad, members in stores:
            view = flat[at:at + base.size].reshape(base.shape)
            view[...] = grad
            for p in members:
                p.grad_base, p.grad = view, view[p.view]
            at += base.size
        self.buckets.append((flat, ready_after))
        self._blocks.append(frozenset(blocks))
        self._groups.append(group)

    def block_done(self, i: int) -> None:
        """Called by the backward pass once block i's gradients are final: start the buckets whose
        blocks are all done now (in bucket order, the same on every replica)."""
        if not self.overlap:
            return
        self._done.add(i)
        for k, (flat, _) in enumerate(self.buckets):
            if k not in self._started and self._blocks[k] and self._blocks[k] <= self._done:
                self._started.add(k)
                self._pending.append((self._groups[k].iall_reduce(flat), flat))
        for pending, _ in self._pending:
            pending.test()                                  # drive MPI's progress engine

    def chunk(self, offset: int) -> "ChunkReducer":
        """What one pipeline chunk's GPT.backward takes as its reducer: its block i is block
        offset + i of the model given here (the stage); finishing is left to the stage."""
        return ChunkReducer(self, offset)

    def finish(self) -> None:
        """After the backward pass: reduce what is left, wait for everything, divide by D."""
        if self.group.size == 1:
            return
        if self.hierarchical is not None:
            for (flat, _), g in zip(self.buckets, self._groups):
                (self.hierarchical_experts if g is not self.group else self.hierarchical).all_reduce(flat)
                flat *= 1.0 / self.group.size
            return
        for k, (flat, _) in enumerate(self.buckets):
            if k not in self._started:
                self._pending.append((self._groups[k].iall_reduce(flat), flat))
        for pending, flat in self._pending:
            pending.wait()
            flat *= 1.0 / self.group.size              # experts too: summed over edp, they hold all dp shares
        self._pending, self._done, self._started = [], set(), set()


class ChunkReducer:
    """GradReducer.chunk(offset): block_done(i) reports block offset + i; finish() does nothing."""

    def __init__(self, reducer: GradReducer, offset: int):
        self.reducer, self.offset = reducer, offset

    def block_done(self, i: int) -> None:
        self.reducer.block_done(self.offset + i)

    def finish(self) -> None:
        """Nothing: the pipeline stage calls GradReducer.finish() after the schedule."""
