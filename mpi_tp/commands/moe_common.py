"""What `explain --layer moe` and `bench --moe` share: the router options on their command lines, and the
bytes each expert dispatcher should count, worked out from every replica's routing.

Legend: E = experts, ep = the expert-parallel group's size, C = channels, routes[s] = (choice (B, S, k),
admitted (B, S, k)) of ep rank s. Per MoE layer and pass (forward, backward), the counters
(mpi_tp.parallel.collectives) should read:

    alltoall   ep/all_to_all      1 call   (ep - 1) x E_max x 8 (int64)    the counts (forward only)
               ep/all_to_allv     2 calls  (rows out + rows back) x C x itemsize
    allgather  ep/all_gather_counts 1 call ep x E x 8                       the counts (forward only)
               ep/all_gather      1 call   (every replica's admitted rows) x C x itemsize
               ep/reduce_scatter  1 call   the same
    tp > 1     tp/routing, tp/routing_sums, tp/expert_counts, tp/etp_counts   the whole sequences' routing
               tp/etp_gather, tp/etp_reduce   1 call  (rows the tp group's experts compute) x C x itemsize
               tp/all_gather      1 call   the replica's B S positions' outputs (or input gradients)
               tp/all_reduce      1 call   shared experts only: its replica's N tokens x C x itemsize

Buffer bytes; the wire bytes are the all-to-all's buffer bytes and (ep - 1) / ep of the all-gather's
and reduce-scatter's (ring). Per rank and token under uniform dropless routing, the wire bytes are
4 k (ep - 1) / ep^2 C itemsize (all-to-all) and 4 k (ep - 1) / ep C itemsize (all-gather): ep times
more, because every row reaches the ep - 1 other ranks instead of the one holding its expert.
"""
from __future__ import annotations

import numpy

from mpi_tp.model.routing import DROP_POLICIES, ROUTERS, TOPK_NORMS
from mpi_tp.parallel.expert_parallel import DISPATCHERS
from mpi_tp.parallel.topology import split_sizes


def add_router_arguments(p, used: str) -> None:
    """--moe-router, --moe-topk-norm, --moe-gate-scale, --moe-drop-policy, --moe-dispatcher (used: "with
    --layer moe" or "with --moe", the help's prefix)."""
    p.add_argument("--moe-router", choices=ROUTERS, default="softmax",
                   help=f"{used}: 'softmax' (top-k of softmax over the experts: Switch, GShard), 'topk-softmax' "
                        "(softmax over the k best logits: Mixtral) or 'sigmoid' (each expert's sigmoid: "
                        "DeepSeek-V3) (default softmax)")
    p.add_argument("--moe-topk-norm", choices=TOPK_NORMS, default="auto",
                   help=f"{used}: the k gates divided by their sum: 'sum', 'none', or 'auto' (sum when k > 1; "
                        "topk-softmax always) (default auto)")
    p.add_argument("--moe-gate-scale", type=float, default=1.0,
                   help=f"{used}: each gate multiplied by this (DeepSeek-V3's routed scaling factor, 2.5)")
    p.add_argument("--moe-drop-policy", choices=DROP_POLICIES, default="position",
                   help=f"{used}: past the capacity drop by 'position' (later choices, then later positions) "
                        "or by 'probs' (the lowest gates first) (default position)")
    p.add_argument("--moe-dispatcher", choices=tuple(DISPATCHERS), default="alltoall",
                   help=f"{used}: how rows reach the experts: 'alltoall' (each row to its expert's rank and "
                        "back) or 'allgather' (every row to every rank, results reduce-scattered back) "
                        "(default alltoall)")


def router_fields(args) -> dict:
    """The GPTConfig fields of those options."""
    return {"moe_router": args.moe_router, "moe_topk_norm": args.moe_topk_norm,
            "moe_gate_scale": args.moe_gate_scale, "moe_drop_policy": args.moe_drop_policy,
            "moe_dispatcher": args.moe_dispatcher}


def owners(E: int, ep: int):
    """Expert -> the ep rank holding it (split_sizes: the first E % ep ranks hold one more)."""
    return numpy.repeat(numpy.arange(ep), split_sizes(E, ep))


def moved_rows(routes, E: int, me: int) -> tuple[int, int]:
    """From every replica's (choice, admitted): rows ep rank `me` dispatches to other ranks (its tokens'
    admitted assignments to experts it does not hold), and rows it returns (other replicas' admitted
    assignments to its experts). Each crosses twice per pass (there, and back as a result or gradient)."""
    owner = owners(E, len(routes))
    c, a = routes[me]
    out = int((a & (owner[c] != me)).sum())
    back = sum(int((a_s & (owner[c_s] == me)).sum()) for s, (c_s, a_s) in enumerate(routes) if s != me)
    return out, back


def expected_counters(routes, E: int, me: int, C: int, itemsize: int, dispatcher: str, tp: int = 1,
                      rows_group: int = 0, shared_rows: int = 0, shape=(0, 0, 0)) -> dict:
    """{"expect": {(pass, key): (calls, buffer bytes)}, "why": {(pass, key): text}, "out", "back"} for ep rank
    `me` (the module docstring's table); routes: the positions each ep rank routed (its own). With tp > 1:
    rows_group, the rows its tp (= etp) group's experts compute; shape (B, S, k) of its replica's batch;
    shared_rows: its replica's tokens when the layer has shared experts (a tp all-reduce each way)."""
    ep = len(routes)
    out, back = moved_rows(routes, E, me)
    expect, why = {}, {}
    if ep > 1 and dispatcher == "allgather":
        total = sum(int(a.sum()) for _, a in routes)                    # every replica's admitted rows
        expect[("forward", "ep/all_gather_counts")] = (1, ep * E * 8)
        why[("forward", "ep/all_gather_counts")] = f"ep x E x 8 (int64 counts) = {ep} x {E} x 8"
        for phase in ("forward", "backward"):
            for key in ("ep/all_gather", "ep/reduce_scatter"):
                expect[(phase, key)] = (1, total * C * itemsize)
                why[(phase, key)] = f"(every replica's {total} admitted rows) x C {C} x {itemsize} bytes"
    elif ep > 1:
        E_max = max(split_sizes(E, ep))
        expect[("forward", "ep/all_to_all")] = (1, (ep - 1) * E_max * 8)
        why[("forward", "ep/all_to_all")] = f"(ep - 1) x E_max x 8 (int64 counts) = {ep - 1} x {E_max} x 8"
        for phase, what in (("forward", "rows"), ("backward", "gradient rows")):
            expect[(phase, "ep/all_to_allv")] = (2, (out + back) * C * itemsize)
            why[(phase, "ep/all_to_allv")] = f"({out} {what} out + {back} back) x C {C} x {itemsize} bytes"
    if tp > 1:                  # each tp rank routes its own positions (mpi_tp.parallel.expert_tokens)
        B, S, k = shape
        E_i = split_sizes(E, ep)[me]
        forward = {"tp/routing": (B * S * k * 8, f"B {B} x S {S} x k {k} x 8 (int64 choices)"),
                   "tp/routing_sums": ((B * E + 1) * itemsize, f"(B {B} x E {E} + 1) x {itemsize}"),
                   "tp/expert_counts": (E * 8, f"E {E} x 8 (int64: the whole sequences' rows per expert)"),
                   "tp/etp_counts": (tp * E_i * 8, f"tp {tp} x E_i {E_i} x 8 (int64 counts)")}
        for key, (nbytes, text) in forward.items():
            expect[("forward", key)], why[("forward", key)] = (1, nbytes), text
        for phase in ("forward", "backward"):
            for key in ("tp/etp_gather", "tp/etp_reduce"):
                expect[(phase, key)] = (1, rows_group * C * itemsize)
                why[(phase, key)] = f"(R = {rows_group} rows of the tp group, C {C}) x {itemsize} bytes"
            expect[(phase, "tp/all_gather")] = (1, B * S * C * itemsize)
            why[(phase, "tp/all_gather")] = f"B {B} x S {S} x C {C} x {itemsize} bytes (the positions' outputs)"
            if shared_rows:
                expect[(phase, "tp/all_reduce")] = (1, shared_rows * C * itemsize)
                why[(phase, "tp/all_reduce")] = f"({shared_rows} rows of the shared experts, C {C}) x {itemsize} bytes"
    return {"expect": expect, "why": why, "out": out, "back": back}


def wire_sent(counters: dict, ep: int) -> float:
    """Wire bytes a rank sends for the ep collectives of one layer's step, from expected_counters' "expect"."""
    half = (ep - 1) / ep if ep > 1 else 0.0
    return sum(nbytes * (1.0 if key.endswith(("all_to_all", "all_to_allv")) else half)
               for (_, key), (_, nbytes) in counters.items() if key.startswith("ep/"))
