"""After the last micro-batch's backward pass: every gradient made final, in one place.

    for m in micro-batches: model.forward(...); model.backward(..., reducer if last else None)
    finalize_grads(model, reducer)

Megatron-LM's finalize_model_grads. The backward passes leave each rank's own
gradients, accumulated over the micro-batches; what the layout needs then is
done once per step, whatever the number of micro-batches M:

  1. sequence parallelism: the replicated parameters that act on each position
     (Param.sp_partial: LayerNorms, row-parallel biases, the position table)
     got only this rank's positions' part: sum over tp;
  1b. grouped-query attention with fewer key/value heads than tensor-parallel
     ranks: each replica of a key/value head (Param.replicas) got its own query
     heads' part of the gradient: sum over the replica group (mpi_tp.model.heads);
  2. pipelines: the tied table wte has a copy on the first and on the last
     stage, each with its own part of the gradient: sum them over the stages
     that hold one (mpi_tp.parallel.pipeline.embedding_group); under ZeRO-3,
     where the whole gradients are gone by then, their shares after 3;
  3. data parallelism: average over the replicas (or, for the distributed
     optimizer, reduce-scatter into each rank's share).

With a GradReducer (mpi_tp.parallel.data_parallel), 1, 1b and 3 run bucket by
bucket, most of them during the last backward pass; finish() does the buckets
left (the embeddings and ln_f, after 2) and waits. Without one, 1 is one
packed all-reduce of every sp_partial gradient, 1b one of every replica's. The sums commute with the
average, so the order does not change the numbers.
"""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.core.failpoints import planted


def sum_packed(params, group, kind: str) -> None:
    """These parameters' gradients summed over `group` in one packed all-reduce (a no-op for one rank)."""
    if group.size == 1 or not params:
        return
    buf = backend.xp().concatenate([p.grad.reshape(-1) for p in params])
    group.all_reduce(buf, kind=kind)
    at = 0
    for p in params:
        p.grad[...] = buf[at:at + p.grad.size].reshape(p.grad.shape)
        p.fresh = False
        at += p.grad.size


def sum_sp_partial_grads(params, group) -> None:
    """Every sp_partial gradient (this rank's positions' parts) summed over the tensor-parallel group."""
    if not planted("bug-sp-grads"):
        sum_packed([p for p in params if p.sp_partial], group, "sp_grad_all_reduce")


def sum_replica_grads(params) -> None:
    """Every replicated shard's gradient (Param.replicas: this rank's query heads' parts) summed over its
    replica group, one packed all-reduce per group (a rank's key/value heads are the same in every
    block: one group)."""
    groups = {}
    for p in params:
        if p.replicas is not None:
            groups.setdefault(id(p.replicas), (p.replicas, []))[1].append(p)
    for group, members in groups.values():
        sum_packed(members, group, "kv_grad_all_reduce")


def finalize_grads(model, reducer=None) -> None:
    """Complete this step's gradients (see the module docstring). model: a GPT or a PipelineStage;
    reducer: its GradReducer, whose buckets the last backward pass started (or None)."""
    if reducer is None or not reducer.buckets:
        sum_sp_partial_grads(model.parameters(), model.topo.tp)
        sum_replica_grads(model.parameters())
    tied = getattr(model, "tied_embedding", None)
    sharded = reducer is not None and reducer.stage == 3       # ZeRO-3: the copies' shares, once reduced
    if tied is not None and not sharded:
        tied.sum_grads()
    if reducer is not None:
        reducer.finish()
    if tied is not None and sharded:
        tied.sum_shares(reducer.buckets)
