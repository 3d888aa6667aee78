"""Memory per rank in the cost model: model state, activations held for the backward pass, logits.

Weights, gradients and optimizer state of the rank's layers (ZeRO-1 divides the
state by D), plus activations: our own count per layer (docs/parallelism.md)
for implementations like this one, Korthikanti et al.'s for Megatron-style
16-bit training, times the micro-batches in flight (at most P under 1F1B on the
first stage, which holds the most); with recomputation only each layer's input
and one layer's full activations.
"""
from __future__ import annotations

import math

from mpi_tp.planning.costmodel import Layout, Workload
from mpi_tp.planning.machines import Machine


def activation_bytes_per_layer(m: Machine, w: Workload, lay: Layout) -> float:
    s, b, h, a, t = w.seq, lay.micro_batch, w.n_embd, w.n_head, lay.tp
    if m.activations == "korthikanti":
        if lay.sp or t == 1:
            return s * b * h * (34 + 5 * a * s / h) / t
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    rep, par = (2, 18) if lay.sp and t > 1 else (4, 16)
    return 4 * (s * b * h * (rep + par / t) + a * s * s * b / t)


def memory_per_rank(m: Machine, w: Workload, lay: Layout) -> dict:
    """Bytes per rank: model state and activations (the first pipeline stage, which holds the most)."""
    params_rank = w.params / (lay.tp * lay.pp)
    weights_grads = params_rank * 8 if m.state_bytes_per_param >= 16 else params_rank * 4
    optimizer = params_rank * (m.state_bytes_per_param - (8 if m.state_bytes_per_param >= 16 else 4))
    if lay.zero:
        optimizer /= lay.dp
    layers = math.ceil(w.n_layer / lay.pp)
    in_flight = min(lay.pp, max(1, w.global_batch // (lay.dp * lay.micro_batch)))
    per_layer = activation_bytes_per_layer(m, w, lay)
    if lay.recompute:
        layer_inputs = w.seq * lay.micro_batch * w.n_embd * m.bytes_per_value / (lay.tp if lay.sp else 1)
        acts = in_flight * layers * layer_inputs + per_layer
    else:
        acts = in_flight * layers * per_layer
    logits = lay.micro_batch * w.seq * w.vocab / lay.tp * 4 * 2          # logits and softmax, float32
    total = weights_grads + optimizer + acts + logits
    return {"total": total, "weights_grads": weights_grads, "optimizer": optimizer, "activations": acts,
            "logits": logits}
