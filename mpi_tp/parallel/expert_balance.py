"""The aux-loss-free load balance of DeepSeek-V3 (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing"):
each MoE block keeps a bias b (E,) that is added to the router's scores for the top-k choice only (the gates
stay the scores: mpi_tp.model.routing), and after every optimizer step moves each expert's bias by

    b_e += rate * sign(mean_e' load_e' - load_e)          load_e: the step's assignments that chose e

so an expert that took more than its share becomes less likely to be chosen, without a gradient and without
a loss term that pulls against the language model's. The loads are the whole global batch's: every
micro-batch's choices (counted in its backward, so a recomputed forward counts once and an evaluation none)
summed over the data-parallel replicas (one small all-reduce, `dp/expert_load`, E integers per MoE block,
exact in float64); tensor-parallel ranks route the same tokens and pipeline stages own their blocks, so
neither sums. Every rank then moves its copy of b alike. A step that is skipped (fp16 overflow, a non-finite
loss) moves nothing: `reset` drops its counts.

    mpi-tp train --moe-experts 8 --moe-top-k 2 --moe-router sigmoid --moe-bias-rate 0.001 --moe-aux-weight 0
"""
from __future__ import annotations

import numpy

from mpi_tp.core import backend


def balancing(model) -> list:
    """The MoE layers of this model or stage that move their bias (moe_bias_rate > 0)."""
    return [m for m in model.moe_layers() if m.bias_rate > 0]


def reset(model) -> None:
    """Forget the loads counted so far (at the start of a step)."""
    for m in balancing(model):
        m.load[...] = 0


def balance_experts(model) -> None:
    """After an optimizer step: the step's loads summed over the replicas, each bias moved (module docstring)."""
    layers = balancing(model)
    if not layers:
        return
    loads = numpy.stack([backend.asnumpy(m.load) for m in layers]).astype(numpy.float64)    # (layers, E)
    model.topo.dp.all_reduce(loads, kind="expert_load")
    for m, load in zip(layers, loads):
        step = numpy.sign(load.mean() - load) * m.bias_rate
        m.expert_bias.data += backend.asarray(step.astype(m.expert_bias.data.dtype))
        m.load[...] = 0
