"""Memory per rank in the cost model: model state, activations held for the backward pass, logits.

Weights, gradients and optimizer state of the rank's layers, by the bytes per parameter
machines.state_bytes reads off the machine (or `mpi-tp plan --precision`: machines.with_precision):

    precision          weights  grads  fp32 masters  AdamW m, v   total   ZeRO-1 over D
    fp32               4        4      -             4 + 4        16      4 + 4 + 8/D (+ 4/D)
    bf16, fp16         2        2      4             4 + 4        16      2 + 2 + 12/D (+ 2/D)
    presets (Megatron) 2        4      4             4 + 4        18      (fp32 gradients: Megatron's main_grad)

(the distributed optimizer, ZeRO-1, divides the masters and moments by D and keeps a 1/D share
of the gradients besides them, the bracket), plus activations: per layer, term by term, this
code's count (values at the bytes per value, statistics fp32, 1-byte dropout masks) or Korthikanti
et al.'s for Megatron-style training (mpi_tp.planning.activations), times the
micro-batches in flight (at most P under 1F1B on the first stage, which holds
the most); with recomputation only each layer's input and one layer's full
activations. Context parallelism (cp = Z) leaves S / Z positions on a rank,
and its ring attention keeps q, k and v but no (S, S) array (the terms of
selective recomputation at S / Z); the optimizer state is shared over Z D.
"""
from __future__ import annotations

import math

from mpi_tp.planning import activations
from mpi_tp.planning.costmodel import Plan, Workload
from mpi_tp.planning.machines import Machine, state_bytes


def activation_bytes_per_layer(m: Machine, w: Workload, lay: Plan) -> float:
    """One layer's activations on the rank that keeps the most (mpi_tp.planning.activations: this code's
    count, or Korthikanti et al.'s for 16-bit Megatron-style training)."""
    S, B, C, H, T = w.seq / lay.cp, lay.micro_batch, w.n_embd, w.n_head, lay.tp
    ring = "selective" if lay.cp > 1 else "none"        # ring attention keeps no (S, S) array
    if m.activations == "korthikanti":
        return activations.activation_bytes_per_layer(S, B, C, H, T, lay.sp, recompute=ring, paper=True,
                                                      value_bytes=m.bytes_per_value)
    return activations.activation_bytes_per_layer(S, B, C, H, T, lay.sp, w.dropout, recompute=ring,
                                                  value_bytes=m.bytes_per_value)


def params_per_rank(w: Workload, lay: Plan) -> float:
    """Parameters a rank of the first pipeline stage holds: its shards of the split matrices (q/k/v, the
    projections, fc, the vocabulary rows of wte: 12 C^2 + 7 C per layer / T) and, whole, what every
    tensor-parallel rank replicates (LayerNorms and row biases: 6 C per layer, wpe S C, ln_f 2 C)."""
    T, C, layers = lay.tp, w.n_embd, math.ceil(w.n_layer / lay.pp)
    sharded = layers * (12 * C * C + 7 * C) / T + math.ceil(w.vocab / T) * C
    replicated = layers * 6 * C + w.seq * C + (2 * C if lay.pp == 1 else 0)
    moe = math.ceil(w.moe_layers / lay.pp)            # an MoE block: E / ep experts instead of one MLP, a router
    if moe:
        sharded += moe * (math.ceil(w.experts / lay.ep) - 1) * w.expert_params / T
        replicated += moe * C * w.experts
    return sharded + replicated


def memory_per_rank(m: Machine, w: Workload, lay: Plan) -> dict:
    """Bytes per rank: model state and activations (the first pipeline stage, which holds the most)."""
    params_rank, state = params_per_rank(w, lay), state_bytes(m)
    weights_grads = params_rank * (state["weights"] + state["grads"])
    optimizer = params_rank * (state["master"] + state["moments"])
    shares = lay.dp * lay.cp         # the ranks holding the same weights (the reducer's group)
    if lay.zero and shares > 1:      # the distributed optimizer: its share of the state, and of the gradients
        optimizer /= shares
        weights_grads += params_rank * state["grads"] / shares
    layers = math.ceil(w.n_layer / lay.pp)
    in_flight = min(lay.pp, max(1, w.global_batch // (lay.dp * lay.micro_batch)))
    per_layer = activation_bytes_per_layer(m, w, lay)
    if lay.recompute:
        layer_inputs = w.seq / lay.cp * lay.micro_batch * w.n_embd * m.bytes_per_value / (lay.tp if lay.sp else 1)
        acts = in_flight * layers * layer_inputs + per_layer
    else:
        acts = in_flight * layers * per_layer
    # the logits at the value width, the cross-entropy's softmax in fp32 (or wider)
    logits = lay.micro_batch * w.seq / lay.cp * w.vocab / lay.tp * (m.bytes_per_value + max(m.bytes_per_value, 4))
    total = weights_grads + optimizer + acts + logits
    return {"total": total, "weights_grads": weights_grads, "optimizer": optimizer, "activations": acts,
            "logits": logits}
