"""`mpi-tp plan`'s mixture-of-experts options: the names `mpi-tp train` gives them, their checks, the words.

    mpi-tp plan ... --moe-experts 8 --moe-top-k 2 [--moe-shared-experts 1] [--moe-capacity 1.25]
                    [--moe-dispatcher allgather] [--moe-every 2] [--ep 4] [--etp 1]

The planner's earlier names (--experts, --top-k, --shared-experts, --dispatcher) are kept as aliases.
Pricing: mpi_tp.planning.experts; the search tries ep and etp (mpi_tp.planning.planner).
"""
from __future__ import annotations

import math

from mpi_tp.core.errors import UserError
from mpi_tp.planning.experts import DISPATCHERS


def add_moe_arguments(p) -> None:
    """The MoE options on the plan parser, named as `mpi-tp train` names them."""
    p.add_argument("--moe-experts", "--experts", dest="experts", type=int, default=0,
                   help="a mixture of experts: E experts in every --moe-every-th block (default 0: dense)")
    p.add_argument("--moe-top-k", "--top-k", dest="top_k", type=int, default=1,
                   help="with --moe-experts: experts per token (default 1)")
    p.add_argument("--moe-every", type=int, default=1,
                   help="with --moe-experts: every n-th block is an MoE block (1: every block)")
    p.add_argument("--moe-shared-experts", "--shared-experts", dest="shared_experts", type=int, default=0,
                   help="with --moe-experts: shared experts every token goes through (DeepSeek's; default 0)")
    p.add_argument("--moe-capacity", type=float, default=0.0,
                   help="with --moe-experts: capacity factor per sequence and expert (as `mpi-tp train`'s; "
                        "default 0: dropless); priced as the share min(1, c) of the assignments admitted")
    p.add_argument("--moe-dispatcher", "--dispatcher", dest="dispatcher", choices=DISPATCHERS, default="alltoall",
                   help="with --moe-experts: how rows reach their experts (default alltoall)")
    p.add_argument("--ep", type=int, default=None, help="with --moe-experts: only this expert-parallel size")
    p.add_argument("--etp", type=int, default=None, help="with --moe-experts: only this expert tensor-parallel "
                   "size (default: tp and its divisors are searched; ep x etp divides tp x cp x dp)")


def check_moe(args) -> dict:
    """The MoE options checked (UserError, one line, naming the flag); Workload's fields from them."""
    if args.experts < 0 or args.top_k < 1 or args.moe_every < 1:
        raise UserError("--moe-experts must be >= 0, --moe-top-k and --moe-every at least 1")
    if args.experts and (args.top_k > args.experts or args.moe_every > args.layers):
        raise UserError(f"--moe-top-k {args.top_k} must be at most --moe-experts {args.experts}, and --moe-every "
                        f"{args.moe_every} at most --layers {args.layers}")
    for flag, value in (("--ep", args.ep), ("--etp", args.etp)):
        if value is not None and (value < 1 or not args.experts):
            raise UserError(f"{flag} needs a mixture of experts (--moe-experts E) and must be at least 1")
    if args.ep is not None and args.ep > args.experts:
        raise UserError(f"--ep {args.ep} exceeds --moe-experts {args.experts}: some rank would hold no expert")
    if args.shared_experts < 0 or (args.shared_experts and not args.experts):
        raise UserError("--moe-shared-experts needs a mixture of experts (--moe-experts E) and must be at least 0")
    if not math.isfinite(args.moe_capacity) or args.moe_capacity < 0 or (args.moe_capacity and not args.experts):
        raise UserError(f"--moe-capacity must be a finite number >= 0 (0: dropless) and needs --moe-experts E, "
                        f"got {args.moe_capacity}")
    if args.dispatcher != "alltoall" and not args.experts:
        raise UserError("--moe-dispatcher needs a mixture of experts (--moe-experts E)")
    return dict(experts=args.experts, top_k=args.top_k, moe_every=args.moe_every,
                shared_experts=args.shared_experts, capacity=args.moe_capacity)

