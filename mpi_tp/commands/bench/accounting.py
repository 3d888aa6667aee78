"""What a bench step keeps and sends, at the width it runs in (`mpi-tp bench --precision`): memory per rank by
kind and wire bytes by role, read off the live model, optimizer and counters (nothing estimated here; the
planner's estimate of the same is mpi_tp.planning.memory, set beside these in docs/precision.md).

    memory_per_rank(params, opt)    {"weights", "grads", "master", "moments", "total", "params", "bytes_per_param"}
    measured(meter, comm)           a step's peak by category (mpi_tp.core.memory), on the rank with the largest
    (wire bytes by role, {"tp", "dp_grads", "dp_params", "other"}: mpi_tp.parallel.comm_stats.wire_bytes_by_role)

Mixed-precision AdamW keeps 2 + 2 + 12 bytes per parameter (bf16 weights and gradients, fp32 masters and
two moments; ZeRO-1 keeps a 1/D share of the 12, and a 1/D share of the gradients besides them), fp32
AdamW 4 + 4 + 8. The data-parallel gradient reduction moves the gradients in the reducer's buckets'
dtype (`grad_reduce_dtype`: the 16-bit format today; fp32 once gradients may be reduced in fp32).
"""
from __future__ import annotations

import numpy

from mpi_tp.core.errors import UserError
from mpi_tp.core.memory import CATEGORIES


def memory_per_rank(params, opt) -> dict:
    """Bytes of model state this rank keeps between steps, each storage once (a tied or fused weight
    shares one; ZeRO-2's dropped gradient buffers count nothing)."""
    stores = {id(p.base): p for p in params}.values()
    grads = sum(p.grad_base.nbytes for p in stores if p.grad_base is not None)
    reducer = getattr(opt, "reducer", None)
    if reducer is not None and reducer.distributed:             # ZeRO-1's averaged gradient share
        grads += sum(b.grad_share.nbytes for b in reducer.buckets if b.grad_share is not None)
    state = {k: sum(a.nbytes for a in arrays) for k, arrays in opt.state.items()}
    weights, n = sum(p.base.nbytes for p in stores), sum(p.base.size for p in stores)
    if reducer is not None and getattr(reducer, "stage", 0) == 3:     # ZeRO-3: the shares are what stays
        weights = sum(b.param_share.nbytes for b in reducer.buckets)
        n = sum(b.size for b in reducer.buckets)
    out = {"weights": weights, "grads": grads, "master": state.pop("master", 0), "moments": sum(state.values())}
    out.update(total=sum(out.values()), params=n)
    out["bytes_per_param"] = out["total"] / n
    return out


def measured(meter, comm) -> dict:
    """A metered step's report (mpi_tp.core.memory.MemoryMeter.report) from the rank whose peak is the
    largest (`rank`), with every rank's peak total beside it (`peak_total_per_rank`)."""
    reports = comm.allgather(meter.report())
    totals = [r["peak"]["total"] for r in reports]
    rank = totals.index(max(totals))
    return {**reports[rank], "rank": rank, "peak_total_per_rank": totals}


def describe(m: dict) -> str:
    """One line: the peak and its categories in MiB."""
    peak = m["peak"]
    parts = ", ".join(f"{k} {peak[k] / 2**20:.2f}" for k in CATEGORIES if peak[k])
    device = f"; CuPy pool peak {m['device']['used'] / 2**20:.1f} MiB used" if m.get("device") else ""
    return (f"memory at the step's peak (rank {m['rank']}, after {m['peak_at']}): {peak['total'] / 2**20:.2f} MiB "
            f"= {parts}{device}")


def median(rows: list) -> dict:
    """The per-step median of each role's bytes over the timed steps (the dtype as it is)."""
    return {k: v if isinstance(v, str) else int(numpy.median([r[k] for r in rows])) for k, v in rows[-1].items()}


def check_precision(args) -> None:
    """--precision bf16 / fp16 bench training steps of tp, sp, dp, ZeRO-1 (bf16 on NumPy only, as `mpi-tp train`
    runs it), and say in one line what they do not."""
    if args.precision == "fp32":
        if args.fp32_grads:
            raise UserError("--fp32-grads is for --precision bf16 or fp16 (fp32 gradients are fp32 already)")
        return
    wrong = [flag for flag, on in (("--dtype float64", args.dtype == "float64"), ("--cp", args.cp > 1),
                                   ("--pp", args.pp > 1), ("--inference", args.inference), ("--moe", args.moe),
                                   ("--backend cupy", args.backend == "cupy" and args.precision == "bf16")) if on]
    if wrong:
        raise UserError(f"--precision {args.precision} does not run with {'; '.join(wrong)}: drop it, or bench fp32")
