"""Which links a layout's groups cross: inside a node, or over the network; and what a ring collective costs on one.

The engine's rank order puts tp fastest, then cp, pp and dp (mpi_tp.parallel.topology); a machine
holds ranks_per_node consecutive ranks a node. A group of `size` members `stride` ranks apart whose
members sit on two nodes anywhere waits on the network for every collective (the cost model,
mpi_tp.planning.costmodel, prices it on the network's alpha and bandwidth).
"""
from __future__ import annotations

import math

from mpi_tp.parallel.layout import Layout
from mpi_tp.planning.machines import Machine


def crosses(stride: int, size: int, per_node: int, world: int) -> bool:
    """Whether some group of `size` members `stride` ranks apart (every group of that dimension of a world
    of `world` ranks, placed per_node ranks a node) has members on two nodes."""
    if size <= 1:
        return False
    span = (size - 1) * stride + 1
    if span > per_node:
        return True
    period = stride * size                   # the bases of the groups: q period + r, r < stride
    for q in range(min(per_node // math.gcd(period, per_node), max(1, world // period))):
        if any((q * period + r) % per_node + span > per_node for r in range(stride)):
            return True
    return False


def placement(lay: Layout, per_node: int) -> dict:
    """{"tp" | "cp" | "pp" | "dp": "node" or "network"}: the link each group's collectives cross (dp: the
    gradient reducer's group, cp x dp)."""
    t, c, p, d, W = lay.tp, lay.cp, lay.pp, lay.dp, lay.ranks
    on = {"tp": crosses(1, t, per_node, W), "cp": crosses(t, c, per_node, W), "pp": crosses(t * c, p, per_node, W)}
    on["dp"] = crosses(t * c * p, d, per_node, W) or on["cp"] or (
        d > 1 and c > 1 and (d - 1) * t * c * p + (c - 1) * t + 1 > per_node)
    on["ep"] = crosses(t * c * p, lay.ep, per_node, W)          # ep consecutive members of dp
    return {k: "network" if v else "node" for k, v in on.items()}


def link(where: str, m: Machine) -> tuple:
    """(alpha, bw) of a group's link: "node" or "network"."""
    return (m.intra_alpha, m.intra_bw) if where == "node" else (m.inter_alpha, m.inter_bw)


def ring_all_reduce(n_bytes: float, p: int, alpha: float, bw: float) -> float:
    """2 (T-1) alpha + 2 (T-1)/T n / bw (p: the group size T): a reduce-scatter, then an all-gather."""
    return 0.0 if p <= 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * n_bytes / bw


def ring_all_gather(n_bytes: float, p: int, alpha: float, bw: float) -> float:
    """(T-1) alpha + (T-1)/T n / bw (p: the group size T); also the time of a reduce-scatter of n bytes."""
    return 0.0 if p <= 1 else (p - 1) * alpha + (p - 1) / p * n_bytes / bw
