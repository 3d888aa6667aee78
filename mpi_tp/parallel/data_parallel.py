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
  3. --zero 2: once a bucket's reduce-scatter is done its whole gradients are
     let go (hold_grads brings them back, zeroed, before the next step's first
     backward); --zero 3: the buckets are one block each and hold parameter
     shares only, and the model's FSDP (mpi_tp.parallel.fsdp) gathers and
     reduces them piece by piece on every micro-batch instead of block_done
     and finish's buckets (mpi_tp.parallel.buckets says what each stage holds).

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

from mpi_tp.core.failpoints import planted
from mpi_tp.parallel.buckets import make_buckets
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.expert_parallel import expert_of
from mpi_tp.parallel.fsdp import FSDP
from mpi_tp.parallel.grad_release import ChunkGrads, GradRelease
from mpi_tp.parallel.hierarchical import HierarchicalAllReduce


class GradReducer:
    """Completes and averages the gradients over `group` (the data-parallel group; experts over edp),
    bucket by bucket; hook it into GPT.backward and call finish() after the last backward
    (mpi_tp.parallel.finalize.finalize_grads does).

    distributed: the distributed optimizer's reduce-scatter instead of the all-reduce (ZeRO-1);
    stage: its ZeRO stage (mpi_tp.parallel.buckets): 2 drops the whole gradients once reduce-scattered,
    3 shards the parameters too and hands the buckets to an FSDP (mpi_tp.parallel.fsdp) set on the
    model as model.fsdp, which gathers and reduces them layer by layer. Without distributed (or with a
    one-rank group) the stage is 0.
    """

    def __init__(self, model, group: Group, bucket_mb: float = 8.0, overlap: bool = True,
                 hierarchical: bool = False, distributed: bool = False, stage: int = 1):
        if stage not in (1, 2, 3):
            raise ValueError(f"the distributed optimizer's ZeRO stage is 1, 2 or 3, not {stage}")
        self.group, self.overlap = group, overlap and not hierarchical
        self.distributed = distributed and group.size > 1
        self.stage = stage if self.distributed else 0
        if self.stage == 3 and hierarchical:
            raise ValueError("ZeRO-3 reduce-scatters layer by layer: no hierarchical all-reduce")
        self.tp = model.topo.tp
        self._done, self._started, self._pending, self._gathers = set(), set(), [], []
        tp_sums = self.tp.size > 1 and any(p.sp_partial or p.replicas is not None for p in model.parameters())
        edp_sums = any(expert_of(p) is not None and expert_of(p).edp.size > 1 for p in model.parameters())
        self.buckets = make_buckets(model, group, bucket_mb, self.distributed, self.stage) \
            if group.size > 1 or tp_sums or edp_sums else []
        self.fsdp = FSDP(model, self) if self.stage == 3 else None
        self.release = GradRelease(self.buckets) if self.stage == 2 else None
        self.grad_dtype = self.buckets[0].grad_dtype if self.buckets else None    # what the reductions carry
        self.hierarchical = {}       # group name -> HierarchicalAllReduce
        if hierarchical and group.size > 1:
            for g in {b.group.name: b.group for b in self.buckets if b.group.size > 1}.values():
                self.hierarchical[g.name] = HierarchicalAllReduce(g)

    def _start(self, k: int) -> None:
        """Bucket k is final on this rank: sum its sp_partial part over tp, start its collective over the group."""
        b = self.buckets[k]
        self._started.add(k)
        self.sum_over_tp(b)
        if self.hierarchical or (self.group.size == 1 and b.group.size == 1):   # hierarchical: in finish()
            return
        if self.distributed and b.group.size == 1:        # experts held by one replica (ep = D): nothing to sum
            b.grad_share[...] = b.grads
            pending = None
        elif self.distributed:
            pending = b.group.ireduce_scatter(b.grads, b.shares, axis=0, out=b.grad_share)
        else:
            pending = b.group.iall_reduce(b.grads)
        self._pending.append((k, pending))

    def sum_over_tp(self, b) -> None:
        """Bucket b's sp_partial gradients summed over tp, its replicated key/value shards' over their group."""
        if b.sp.start < b.sp.stop and not planted("bug-sp-grads"):
            self.tp.all_reduce(b.grads[b.sp], kind="sp_grad_all_reduce")
        if b.replicas.start < b.replicas.stop:
            b.replica_group.all_reduce(b.grads[b.replicas], kind="kv_grad_all_reduce")

    def hold_grads(self) -> None:
        """ZeRO-2's whole gradients, dropped after the last step's reduction, held again (zeroed) all at
        once (a backward that is not told block by block: GradReducer.grads). Other stages: nothing."""
        if self.stage == 2:
            for b in self.buckets:
                b.hold_grads()

    def grads(self, offset: int = 0):
        """ZeRO-2: what GPT.backward calls need(i) on before block i's backward (None: the head and the
        embedding), holding each bucket's whole gradients only from then (mpi_tp.parallel.grad_release);
        None at the other stages."""
        return ChunkGrads(self.release, offset) if self.release is not None else None

    def block_done(self, i: int) -> None:
        """Called by the backward pass once block i's gradients are final: start the buckets whose
        blocks are all done now (in bucket order, the same on every replica). ZeRO-3: nothing, its
        FSDP reduces each block after every micro-batch's backward."""
        if not self.overlap or self.stage == 3:
            return
        self._done.add(i)
        for k, b in enumerate(self.buckets):
            if k not in self._started and b.blocks and b.blocks <= self._done:
                self._start(k)
        for k, pending in self._pending:
            if pending is not None and pending.test() and self.stage == 2:     # (drives MPI's progress)
                self.buckets[k].drop_grads()                 # ZeRO-2: the share has it all already

    def chunk(self, offset: int) -> "ChunkReducer":
        """What one pipeline chunk's GPT.backward takes as its reducer: its block i is block
        offset + i of the model given here (the stage); finishing is left to the stage."""
        return ChunkReducer(self, offset)

    def finish(self) -> None:
        """After the backward pass: start what is left, wait for everything, divide by D (ZeRO-2: then
        drop the whole gradients; ZeRO-3: the FSDP's own finish)."""
        if self.fsdp is not None:
            self.fsdp.finish()
            return
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
        self._pending, self._done, self._started = [], set(), set()
        if self.stage == 2:                               # the shares are all the update reads
            for b in self.buckets:
                b.drop_grads()

    def gather_params(self, k: int) -> None:
        """Distributed optimizer: bucket k's share is updated; start all-gathering its parameters."""
        b = self.buckets[k]
        if b.group.size > 1 and self.stage < 3:           # ZeRO-3 keeps the shares: FSDP gathers per layer
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
