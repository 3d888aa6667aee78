"""The router of a mixture-of-experts block, as pure functions: scores, top-k, gates, capacity, the losses.

Legend (docs/notation.md): N = B S tokens, E = experts, k = experts per token; z (N, E) the router's
logits x W_r. Three routers, as the models that use them define them (cfg.moe_router):

    "softmax"       prob = softmax(z) over the E experts, top-k of prob, g = prob_top  Switch, GShard,
                    (k = 1: the probability itself, so the router learns from the loss)  DeepSeek-V2
    "topk-softmax"  top-k of z, gate = softmax(z_top) over the k alone                  Mixtral, Megatron's
                    (= prob_top / sum prob_top: softmax-then-top-k normalised, computed default
                    the other way round; at k = 1 the gate is 1)
    "sigmoid"       s = sigmoid(z) for each expert on its own, top-k of s, g = s_top     DeepSeek-V3

Normalised top-k weights (cfg.moe_topk_norm): "sum" divides the k gates by their sum, "none" keeps
them, "auto" is "sum" for k > 1 and "none" for k = 1 (topk-softmax is normalised by definition).
Then each gate is multiplied by cfg.moe_gate_scale (DeepSeek-V3's routed_scaling_factor, 2.5).

An expert bias b (E,) (the aux-loss-free balancing of DeepSeek-V3) changes the choice only: top-k of
score + b, the gates still from the scores. Ties go to the lower expert index.

The load-balancing loss balances a distribution over the experts: prob = softmax(z) for the softmax
routers, s / sum_e s for the sigmoid one (DeepSeek-V3's sequence-wise loss); the z-loss reads
lse = logsumexp(z) for every router.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from mpi_tp.core import backend

ROUTERS = ("softmax", "topk-softmax", "sigmoid")
TOPK_NORMS = ("auto", "sum", "none")
DROP_POLICIES = ("position", "probs")


class Routed(NamedTuple):
    """What route() decides and what its backward needs (each (N, E) or (N, k); lse (N,))."""
    p: object          # the distribution the aux loss balances
    soft: object       # softmax(z): the z-loss's d lse / dz (the same array as p for the softmax routers)
    score: object      # what top-k chose from, before any bias (p, z or s)
    lse: object
    choice: object     # (N, k) best first
    weight: object     # (N, k) the gates before moe_gate_scale
    gate: object       # (N, k) weight * scale


def normalises(router: str, topk_norm: str, k: int) -> bool:
    """Whether the k gates are divided by their sum (see the module docstring)."""
    return router == "topk-softmax" or topk_norm == "sum" or (topk_norm == "auto" and k > 1)


def top_k(score, k: int):
    """(N, E) -> (N, k) indices of the k largest, best first; ties to the lower index (argmax's first)."""
    xp = backend.array_module(score)
    rest, choice = score.copy(), []
    rows = xp.arange(score.shape[0])
    for _ in range(k):
        c = rest.argmax(axis=1)
        choice.append(c)
        rest[rows, c] = -xp.inf
    return xp.stack(choice, axis=1)


def sigmoid(z):
    """1 / (1 + e^-z) without overflow for either sign."""
    xp = backend.array_module(z)
    e = xp.exp(-xp.abs(z))
    return xp.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def route(z, k: int, router: str = "softmax", topk_norm: str = "auto", scale: float = 1.0, bias=None) -> Routed:
    """Router logits z (N, E) -> Routed (the module docstring says what each router computes)."""
    xp = backend.array_module(z)
    m = z.max(axis=1, keepdims=True)
    e = xp.exp(z - m)
    s = e.sum(axis=1, keepdims=True)
    soft = e / s
    lse = (m + xp.log(s))[:, 0]
    if router == "sigmoid":
        score = sigmoid(z)
        p = score / score.sum(axis=1, keepdims=True)
    else:
        score, p = (soft if router == "softmax" else z), soft
    choice = top_k(score if bias is None else score + bias, k)
    chosen = xp.take_along_axis(score, choice, axis=1)                 # (N, k)
    if router == "topk-softmax":                                       # softmax over the k logits
        t = xp.exp(chosen - chosen.max(axis=1, keepdims=True))
        weight = t / t.sum(axis=1, keepdims=True)
    else:
        weight = chosen / chosen.sum(axis=1, keepdims=True) if normalises(router, topk_norm, k) else chosen
    return Routed(p, soft, score, lse, choice, weight, weight if scale == 1.0 else weight * scale)


def route_backward(dgate, r: Routed, router: str, topk_norm: str, scale: float = 1.0, dp=None, dlse=None):
    """dz (N, E) from dgate (N, k), dp (N, E) (the aux loss's gradient on p, or None) and dlse (N,) (the
    z-loss's, or None): the top-k choice is piecewise constant, so only the gates' scores carry it."""
    xp = backend.array_module(r.p)
    N, k = r.choice.shape
    rows = xp.arange(N)[:, None]
    dw = dgate if scale == 1.0 else dgate * scale
    dz = xp.zeros_like(r.p)
    if router == "topk-softmax":            # w = softmax(z_top): dz_top = w (dw - sum dw w)
        dz[rows, r.choice] = r.weight * (dw - (dw * r.weight).sum(axis=1, keepdims=True))
        dsoft = dp
    else:
        if normalises(router, topk_norm, k):   # w_j = c_j / Z  =>  dc_j = (dw_j - sum_l dw_l w_l) / Z
            Z = xp.take_along_axis(r.score, r.choice, axis=1).sum(axis=1, keepdims=True)
            dchosen = (dw - (dw * r.weight).sum(axis=1, keepdims=True)) / Z
        else:
            dchosen = dw
        dscore = xp.zeros_like(r.p)
        dscore[rows, r.choice] = dchosen                               # a token's k choices differ
        if router == "softmax":
            dsoft = dscore if dp is None else dscore + dp
        else:                               # p = s / sum s, then s = sigmoid(z): ds/dz = s (1 - s)
            if dp is not None:
                dscore += (dp - (dp * r.p).sum(axis=1, keepdims=True)) / r.score.sum(axis=1, keepdims=True)
            dz = dscore * r.score * (1.0 - r.score)
            dsoft = None
    if dsoft is not None:
        dz += r.soft * (dsoft - (dsoft * r.soft).sum(axis=1, keepdims=True))
    if dlse is not None:
        dz += dlse[:, None] * r.soft                                   # d lse / dz = softmax(z)
    return dz


def admitted(choice, n_experts: int, capacity: float, priority=None):
    """choice (B, S, k) -> (B, S, k) bool: which assignments fit in their expert's capacity. Each sequence
    admits in order of choice rank, then position (policy "position"), or, given priority (B, S, k) (the
    gates: policy "probs"), highest first, ties in that same order."""
    xp = backend.array_module(choice)
    B, S, k = choice.shape
    if capacity <= 0:
        return xp.ones(choice.shape, dtype=bool)
    cap = math.ceil(round(capacity * S * k / n_experts, 9))          # rounded: 1.1 * 25 * 2 / 11 is 5, not 6
    queue = choice.transpose(0, 2, 1).reshape(B, k * S)               # choice rank first, then position
    if priority is not None:
        order = xp.argsort(-priority.transpose(0, 2, 1).reshape(B, k * S), axis=1, kind="stable")
        queue = xp.take_along_axis(queue, order, axis=1)
    seen = xp.cumsum(queue[:, :, None] == xp.arange(n_experts), axis=1)   # (B, kT, E) so far, itself included
    place = xp.take_along_axis(seen, queue[:, :, None], axis=2)[:, :, 0]  # (B, kT): 1 = first in its queue
    if priority is not None:                                          # back to (choice rank, position) order
        back = xp.empty_like(place)
        back[xp.arange(B)[:, None], order] = place
        place = back
    return (place <= cap).reshape(B, k, S).transpose(0, 2, 1)


def balance_loss(P, choice, n_experts: int, positions: int):
    """aux = mean_b E sum_e f_be P_be (a 0-d array: no copy to the host here) and d aux / dp (N_o, E) at this
    rank's `positions` (B S_o of them) for P (B, E): each sequence's mean probabilities (its positions' p summed
    wherever they live, over S), choice (B, S, k): its whole routing."""
    xp = backend.array_module(P)
    B, S, k = choice.shape
    f = (choice[..., None] == xp.arange(n_experts)).sum(axis=(1, 2)) / (k * S)   # (B, E)
    aux = (f * P).sum() * (n_experts / B)
    dp = xp.broadcast_to((n_experts / (B * S)) * f[:, None, :], (B, positions // B, n_experts))   # through P only
    return aux, dp.reshape(positions, n_experts)


def z_loss(z_lse, total_sq, n: int):
    """zl = mean_n lse_n^2 over n positions (a 0-d array) from total_sq, their lse^2 summed wherever they live,
    and d zl / d lse (N_o,) at this rank's z_lse (N_o,)."""
    return total_sq * (1.0 / n), z_lse * (2.0 / n)
