"""One training step, written once: the micro-batches through the schedule, finalize_grads, clip, update.

    loss = forward_backward(model, x, y, rows, micro_batches, reducer)         # gradients in every Param.grad
    loss, norm, problem = train_step(model, opt, x, y, rows, micro_batches, lr, grad_clip, reducer)
    loss, norm, problem = train_step(..., scaler=LossScaler())                  # fp16: dynamic loss scaling

`model` is a GPT or a pipeline stage; either way the micro-batches run through
a schedule (mpi_tp.parallel.pipeline.schedules): a GPT's is "none", each
micro-batch's forward then its backward, a stage's is GPipe, 1F1B or the
interleaved one (Megatron's get_forward_backward_func: one signature, the
schedule chosen by the layout). `x, y` is the global batch; this replica takes
`rows` (Topology.replica_rows), cut into `micro_batches` equal micro-batches,
each scaled by 1/micro_batches (gradient accumulation). Every micro-batch draws
the dropout masks of this step keyed by its rows in the global batch, so any
(dp, pp, micro_batches) split of the same global batch gives the same numbers.

The data-parallel buckets start during each chunk's last backward pass, when
its gradients are complete, and finalize_grads (mpi_tp.parallel.finalize)
completes them once per step. The loss returned is the global batch's mean,
the same on every rank (the pipeline's stages summed, the replicas averaged),
not finite if any micro-batch's is not. An fp16 model's backward is seeded with the
loss scale (mpi_tp.training.loss_scale), which the update divides out again. train, bench, calibrate, explain and the
tests all step through here.
"""
from __future__ import annotations

import math

import numpy

from mpi_tp.core import memory
from mpi_tp.core.failpoints import armed
from mpi_tp.parallel import expert_balance
from mpi_tp.parallel.finalize import finalize_grads
from mpi_tp.parallel.pipeline.stage import as_stage, micro_batch_rows
from mpi_tp.parallel.trace import span
from mpi_tp.training.optim import clip_coefficient


def forward_backward(model, x, y, rows: slice, micro_batches: int | None = None, reducer=None, meter=None,
                     loss_scale: float = 1.0) -> float:
    """The global batch's mean loss, loss_scale x its gradient accumulated into every Param.grad (zeroed first).

    micro_batches: None for a stage's own M (a GPT: 1). reducer: a data_parallel.GradReducer over the
    model's parameters, or None. meter: a progress.MoEMeter, given each micro-batch's MoE statistics.
    """
    stage = as_stage(model, micro_batches)
    topo, M = stage.topo, stage.M
    stage.zero_grad()
    losses = stage.run_micro_batches(x, y, micro_batch_rows(rows, M), reducer, meter, loss_scale)
    with span(topo.stats.trace, "finalize", "compute"):
        finalize_grads(stage, reducer)
    memory.probe("reduced")                 # the gradients reduced (mpi_tp.core.memory, when a meter samples)
    loss = numpy.array([sum(losses) / M])
    topo.pp.all_reduce(loss)                # the last stage's cross-entropy + every stage's MoE terms
    if topo.dp.size > 1:                    # the global batch's loss: the mean over replicas
        topo.dp.all_reduce(loss)
        loss /= topo.dp.size
    return float(loss[0])


def grad_norm(model, opt) -> float:
    """The whole model's gradient norm, the same on every rank (every stage's parameters, wte once)."""
    counted = {id(p) for p in model.unique_parameters()}
    return opt.grad_norm(model.topo.tp, model.topo.pp, counted)


def train_step(model, opt, x, y, rows: slice, micro_batches: int | None = None, lr: float | None = None,
               grad_clip: float = 1.0, reducer=None, meter=None, step: int | None = None, scaler=None):
    """One optimizer step on the global batch (x, y): (loss, gradient norm, problem).

    problem is None, or what went non-finite; then the update is not applied. The loss and the norm
    are the same on every rank, so all ranks decide alike. lr: None for the optimizer's own; the
    gradient is clipped to norm grad_clip (0: not clipped) inside the update. step: the step's number
    (the trace's, and the failpoints': mpi_tp.core.failpoints). meter (MoE models): takes this
    step's statistics when it is applied. scaler: a loss_scale.LossScaler (fp16), or None; a step
    it skips returns problem = a loss_scale.Overflow.
    """
    if meter is not None:
        meter.begin()
    expert_balance.reset(model)
    scale = 1.0 if scaler is None else scaler.scale          # this step's, before the check moves it
    topo = model.topo
    loss = forward_backward(model, x, y, rows, micro_batches, reducer, meter, scale)
    if not math.isfinite(loss):
        return loss, float("nan"), f"the loss became {loss}"
    if step is not None and armed("nan-grad", step):
        opt.grads()[0][...] = float("nan")          # what the update would read
    if scaler is not None and step is not None and armed("overflow", step) and topo.world.Get_rank() == topo.world.Get_size() - 1:
        opt.grads()[0][...] = float("inf")          # as an fp16 overflow on one rank would leave it
    norm = grad_norm(model, opt)
    if scaler is not None:
        problem = scaler.check(norm, topo.world, topo.stats)
        if problem is not None:
            return loss, norm / scale, problem
    if not math.isfinite(norm):
        return loss, norm, f"the gradient norm became {norm}"
    norm /= scale                                   # the true gradient's
    with span(topo.stats.trace, "optimizer", "compute", step=step):
        opt.step(lr, grad_scale=clip_coefficient(norm, grad_clip) / scale)     # clip and unscale in the update
    memory.probe("updated")
    expert_balance.balance_experts(model)            # the aux-loss-free bias (MoE, moe_bias_rate > 0)
    if meter is not None:
        meter.commit()
    return loss, norm, None
