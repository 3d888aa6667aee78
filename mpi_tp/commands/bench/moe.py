"""`mpi-tp bench --moe`: a mixture-of-experts MLP at ep = dp = ranks, timed beside a dense MLP of the same
active FLOPs at tp = ranks, with the bytes each moves against the formula.

    mpiexec -n 2 mpi-tp bench --moe                                   # shape a, E 8, k 2, dropless
    mpiexec -n 2 mpi-tp bench --moe --moe-experts 4 --moe-top-k 1 --moe-capacity 1.25 --json out.jsonl
    mpiexec -n 2 mpi-tp bench --moe --moe-dispatcher allgather        # every row to every rank instead
    mpiexec -n 2 mpi-tp bench --moe --moe-router sigmoid --moe-gate-scale 2.5   # DeepSeek-V3's router
    mpiexec -n 2 mpi-tp bench --moe --backend cupy                    # on GPUs, one per rank

The shape's C, S and B are used (B sequences per replica; H and L are not).
A step is one forward and one backward pass of the MLP sublayer alone (no
attention, no optimizer), on fixed inputs x ~ N(0, 1) and output gradients,
after warm-up steps; a step's time is the slowest rank's. The two layers
alternate step by step, so both see the same machine:

- MoE: MoEMLP with E experts of width F = 4C, top-k, --moe-capacity (0: dropless),
  ep = dp = T: rank r holds E_r experts and B S tokens of its own; the router
  options (--moe-router, --moe-topk-norm, --moe-gate-scale, --moe-drop-policy)
  are the model's. --moe-dispatcher alltoall: the all-to-all bytes per step
  are counted (ep/all_to_allv: rows, ep/all_to_all: counts) and set beside the
  routing's exact formula, 2 passes x (rows out + rows back) x C x itemsize,
  and beside the uniform-routing, dropless one: 4 k B S (T - 1) / T x C x
  itemsize. --moe-dispatcher allgather: ep/all_gather and ep/reduce_scatter,
  each the ep group's admitted rows x C x itemsize per pass (4 calls; on the
  wire (T - 1) / T of that), and ep/all_gather_counts, T E int64
  (mpi_tp.commands.moe_common has both formulas).
- dense: fc C -> k F, GELU, proj k F -> C, split column/row over tp = T, on the
  global batch of T B sequences: per rank the same GEMM work as the experts
  (k B S rows x 2 GEMMs with F = 4C, when the routing is balanced). Its
  all-reduces: 2 x (T B S, C) x itemsize per step (wire: 2(T - 1)/T of that each).

Bytes per token are the wire bytes a rank sends (the all-to-all's are its buffer
bytes), per token of the global batch (T B S tokens), mean over the ranks.
The load: rows each expert computed (after the capacity) per rank; imbalance =
max / mean tokens per expert, and the busiest rank's rows over the mean rank's
(what the step waits for).
"""
from __future__ import annotations

import json
import time

import numpy
from mpi4py import MPI

from mpi_tp.commands.moe_common import add_router_arguments, expected_counters, router_fields, wire_sent
from mpi_tp.core import backend
from mpi_tp.core import kernels as kern
from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import rank0_print
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.moe import MoEMLP
from mpi_tp.model.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mpi_tp.parallel.topology import Topology, split_sizes


def add_arguments(b) -> None:
    b.add_argument("--moe", action="store_true",
                   help="time a mixture-of-experts MLP at ep = dp = ranks beside a dense MLP of the same active "
                        "FLOPs at tp = ranks (mpi_tp.commands.bench.moe); default shape a")
    b.add_argument("--moe-experts", type=int, default=8, help="with --moe: experts E (default 8)")
    b.add_argument("--moe-top-k", type=int, default=2, help="with --moe: experts per token k (default 2)")
    b.add_argument("--moe-capacity", type=float, default=0.0,
                   help="with --moe: capacity factor per sequence and expert (default 0: dropless)")
    add_router_arguments(b, "with --moe")


def check(args, ranks: int) -> None:
    """Refuse what --moe cannot do, before anything starts (every rank runs it)."""
    if args.pp > 1 or args.dp > 1 or args.sequence_parallel or args.sweep or args.inference:
        raise UserError("--moe runs ep = dp = ranks (and the dense MLP at tp = ranks): no --pp, --dp, "
                        "--sequence-parallel, --sweep or --inference")
    if args.moe_experts < ranks:
        raise UserError(f"--moe-experts {args.moe_experts} cannot be divided among {ranks} ranks: "
                        f"use --moe-experts {ranks} or more")
    if not 1 <= args.moe_top_k <= args.moe_experts:
        raise UserError(f"--moe-top-k {args.moe_top_k} must be between 1 and --moe-experts {args.moe_experts}")
    if not 0 <= args.moe_capacity < float("inf"):
        raise UserError(f"--moe-capacity must be a finite number >= 0 (0: dropless), got {args.moe_capacity}")
    GPTConfig(vocab_size=256, block_size=1, n_layer=1, n_head=1, n_embd=1, moe_experts=args.moe_experts,
              moe_top_k=args.moe_top_k, **router_fields(args)).validate(1, ranks)     # the router options' checks


class _Dense:
    """The dense comparison: fc (C -> width, column split), GELU, proj (width -> C, row split, g)."""

    def __init__(self, C, width, tp, dtype, seed):
        self.fc = ColumnParallelLinear("dense/fc", C, width, tp, dtype, seed=seed)
        self.proj = RowParallelLinear("dense/proj", width, C, tp, dtype, sizes=self.fc.sizes, seed=seed)

    def step(self, x, dout):
        for layer in (self.fc, self.proj):
            layer.zero_grad()
        h, act = kern.gelu_forward(self.fc.forward(x))
        self.proj.forward(h)
        return self.fc.backward(kern.gelu_backward(self.proj.backward(dout), act))


def _timed(comm, stats, fn) -> tuple[float, dict]:
    """(the slowest rank's seconds, this rank's counters) of one call of fn."""
    stats.reset()
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    backend.synchronize()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX), stats.snapshot()


def _ms(values) -> dict:
    return {"median": 1e3 * float(numpy.median(values)), "min": 1e3 * min(values), "max": 1e3 * max(values)}


def run_moe_shape(comm, C, S, B, E, k, capacity=0.0, steps=10, warmup=3, dtype="float32", seed=0, x=None,
                  routing=None) -> dict:
    """Time the MoE MLP (ep = dp = ranks) and the dense MLP of width k 4C (tp = ranks). x: the global
    batch of inputs (T B, S, C), default N(0, 1); replica r takes sequences r B .. r B + B - 1. routing:
    GPTConfig's router and dispatcher fields (moe_common.router_fields), default the config's."""
    T, itemsize = comm.Get_size(), numpy.dtype(dtype).itemsize
    cfg = GPTConfig(vocab_size=256, block_size=S, n_layer=1, n_head=1, n_embd=C, moe_experts=E, moe_top_k=k,
                    moe_capacity=capacity, **(routing or {}))
    cfg.validate(1, T)
    topo_m, topo_d = Topology.create(comm, tp=1, dp=T, ep=T), Topology.create(comm)
    moe = MoEMLP("h/0/moe", cfg, topo_m, dtype, seed)
    dense = _Dense(C, k * 4 * C, topo_d.tp, dtype, seed)
    rng = numpy.random.default_rng(seed)
    if x is None:
        x = rng.standard_normal((T * B, S, C))
    dout = rng.standard_normal((T * B, S, C))
    x, dout = backend.asarray(x.astype(dtype)), backend.asarray(dout.astype(dtype))
    mine = slice(comm.Get_rank() * B, (comm.Get_rank() + 1) * B)
    xm, dm = x[mine].copy(), dout[mine].copy()

    def moe_step():
        moe.zero_grad()
        moe.forward(xm)
        moe.backward(dm)

    times = {"moe": [], "moe_a2a": [], "dense": [], "dense_ar": []}
    for i in range(warmup + steps):
        t_m, snap_m = _timed(comm, topo_m.stats, moe_step)
        t_d, snap_d = _timed(comm, topo_d.stats, lambda: dense.step(x, dout))
        if i >= warmup:
            times["moe"].append(t_m)
            times["moe_a2a"].append(comm.allreduce(sum(v["seconds"] for v in snap_m.values()), op=MPI.MAX))
            times["dense"].append(t_d)
            times["dense_ar"].append(comm.allreduce(sum(v["seconds"] for v in snap_d.values()), op=MPI.MAX))

    routes = comm.allgather(tuple(backend.asnumpy(a) for a in moe.routing))     # (choice, admitted) per replica
    kind = cfg.moe_dispatcher
    want = expected_counters(routes, E, comm.Get_rank(), C, itemsize, kind)
    out, back = want["out"], want["back"]
    formula = {}                                           # per step: forward + backward, per counter
    for (_, key), (_, nbytes) in want["expect"].items():
        formula[key] = formula.get(key, 0) + nbytes
    routed = numpy.zeros(E, dtype=int)
    admitted = numpy.zeros(E, dtype=int)
    for c, a in routes:
        routed += numpy.bincount(c.reshape(-1), minlength=E)
        admitted += numpy.bincount(c[a], minlength=E)
    sizes = split_sizes(E, T)
    starts = numpy.cumsum([0] + sizes)
    rows_per_rank = [admitted[starts[r]:starts[r + 1]].tolist() for r in range(T)]
    loads = numpy.array([sum(r) for r in rows_per_rank], dtype=float)
    N = T * B * S
    got = {key: v["bytes"] for key, v in snap_m.items()}
    wire = sum(v["wire_bytes"] for key, v in snap_m.items() if key.startswith("ep/"))
    ar = snap_d.get("tp/all_reduce", {"calls": 0, "bytes": 0, "wire_bytes": 0})
    mean_sent = comm.allreduce(wire) / T
    rows_key = "all_to_allv_bytes_rank" if kind == "alltoall" else "all_gather_bytes_rank"
    rows_keys = ("ep/all_to_allv",) if kind == "alltoall" else ("ep/all_gather", "ep/reduce_scatter")
    counts_key = "ep/all_to_all" if kind == "alltoall" else "ep/all_gather_counts"
    # uniform dropless routing: the all-to-all sends (T - 1) / T of its k B S rows, the all-gather's buffer is
    # every replica's k B S rows; both twice per pass, two passes
    uniform = 4 * k * B * S * ((T - 1) / T if kind == "alltoall" else T) * C * itemsize
    gemm = 2 * 2 * C * 4 * C * 3                              # fc and proj, forward + backward, per row
    moe_ms, dense_ms = _ms(times["moe"]), _ms(times["dense"])
    result = {
        "mode": "moe", "shape": {"n_embd": C, "block_size": S, "batch": B}, "ranks": T, "ep": T, "dp": T,
        "experts": E, "top_k": k, "capacity": capacity, "dtype": dtype, "steps": steps, "tokens_per_step": N,
        "routing": {key: getattr(cfg, key) for key in ("moe_router", "moe_topk_norm", "moe_gate_scale",
                                                        "moe_drop_policy", "moe_dispatcher")},
        "moe": {
            "dispatcher": kind, "step_ms": moe_ms, "dispatch_ms": 1e3 * float(numpy.median(times["moe_a2a"])),
            "compute_ms": moe_ms["median"] - 1e3 * float(numpy.median(times["moe_a2a"])),
            "collectives_per_step": {key: {"calls": v["calls"], "bytes": v["bytes"]} for key, v in snap_m.items()},
            "collective_bytes_rank": {key: {"measured": got.get(key, 0), "formula": formula.get(key, 0)}
                                      for key in sorted(set(got) | set(formula))},
            rows_key: {"measured": sum(got.get(key, 0) for key in rows_keys),
                       "formula": sum(formula.get(key, 0) for key in rows_keys),
                       "uniform_formula": uniform if T > 1 else 0},
            "counts_bytes_rank": {"measured": got.get(counts_key, 0), "formula": formula.get(counts_key, 0)},
            "wire_bytes_rank": {"measured": wire, "formula": round(wire_sent(want["expect"], T)),   # rows only:
                                "uniform_formula": 4 * k * B * S * (T - 1) / (T if kind == "alltoall" else 1)
                                * C * itemsize},
            "rows_out_back_rank": [out, back],
            "bytes_per_token": mean_sent / N,
            "rows_per_expert_per_rank": rows_per_rank, "tokens_per_expert": admitted.tolist(),
            "routed_per_expert": routed.tolist(),
            "imbalance": float(admitted.max() / admitted.mean()) if admitted.sum() else 0.0,
            "routed_imbalance": float(routed.max() / routed.mean()),
            "rank_imbalance": float(loads.max() / loads.mean()) if loads.sum() else 0.0,
            "dropped_fraction": float(1 - admitted.sum() / (N * k)),
            "gflop_per_rank": [gemm * n / 1e9 for n in loads],
        },
        "dense": {
            "width": k * 4 * C, "tp": T, "step_ms": dense_ms,
            "all_reduce_ms": 1e3 * float(numpy.median(times["dense_ar"])),
            "compute_ms": dense_ms["median"] - 1e3 * float(numpy.median(times["dense_ar"])),
            "all_reduce_calls": ar["calls"],
            "all_reduce_bytes_rank": {"measured": ar["bytes"], "formula": 2 * N * C * itemsize if T > 1 else 0},
            "wire_bytes_rank": {"measured": ar["wire_bytes"], "formula": round(2 * 2 * (T - 1) / T * N * C * itemsize)},
            "bytes_per_token": ar["wire_bytes"] / N,
            "gflop_per_rank": gemm * N * k / T / 1e9,
        },
    }
    topo_m.free()
    topo_d.free()
    return result


def print_moe(r: dict) -> str:
    m, d, s = r["moe"], r["dense"], r["shape"]
    wire, counts = m["wire_bytes_rank"], m["counts_bytes_rank"]
    ag = m["dispatcher"] == "allgather"
    rows_b = m["all_gather_bytes_rank" if ag else "all_to_allv_bytes_rank"]
    size = numpy.dtype(r["dtype"]).itemsize
    cap = f"capacity {r['capacity']:g}" if r["capacity"] else "dropless"
    cap += "".join(f", {key[4:].replace('_', '-')} {v}" for key, v in r["routing"].items()
                   if key != "moe_dispatcher" and v != {"moe_router": "softmax", "moe_topk_norm": "auto",
                                                        "moe_gate_scale": 1.0, "moe_drop_policy": "position"}[key])
    rows = "; ".join(f"rank {i}: " + " ".join(str(n) for n in per)
                     for i, per in enumerate(m["rows_per_expert_per_rank"]))
    return (f"MoE MLP C={s['n_embd']} S={s['block_size']} B={s['batch']} per replica, E={r['experts']} k={r['top_k']} "
            f"{cap}, ep = dp = {r['ep']}, {r['dtype']}: step {m['step_ms']['median']:.1f} ms (min "
            f"{m['step_ms']['min']:.1f}), {'all-gather' if ag else 'all-to-all'} {m['dispatch_ms']:.1f} ms, compute "
            f"{m['compute_ms']:.1f} ms\n"
            f"  {'all-gather + reduce-scatter' if ag else 'all-to-all'} rows on rank 0: {rows_b['measured']:,} "
            f"bytes per step (routing formula {rows_b['formula']:,}; uniform dropless "
            f"{'4 k B S T' if ag else '4 k B S (T-1)/T'} C {size} = {rows_b['uniform_formula']:,.0f}); counts "
            f"{counts['measured']} bytes (formula {counts['formula']}); wire {wire['measured']:,} (formula "
            f"{wire['formula']:,})\n"
            f"  rows per expert per rank: {rows}; tokens per expert max/mean {m['imbalance']:.2f} (routed "
            f"{m['routed_imbalance']:.2f}), busiest rank {m['rank_imbalance']:.2f} x the mean, dropped "
            f"{100 * m['dropped_fraction']:.1f}%\n"
            f"dense MLP of width k 4C = {d['width']} at tp = {d['tp']} on the same {r['tokens_per_step']} tokens: step "
            f"{d['step_ms']['median']:.1f} ms (min {d['step_ms']['min']:.1f}), all-reduce {d['all_reduce_ms']:.1f} ms, "
            f"compute {d['compute_ms']:.1f} ms\n"
            f"  all-reduce {d['all_reduce_bytes_rank']['measured']:,} bytes per step in {d['all_reduce_calls']} calls "
            f"(formula 2 N C = {d['all_reduce_bytes_rank']['formula']:,}; wire {d['wire_bytes_rank']['measured']:,})\n"
            f"per token of the global batch, each rank sends: MoE {m['bytes_per_token']:.1f} bytes "
            f"({'all-gather, ring wire' if ag else 'all-to-all'}), "
            f"dense {d['bytes_per_token']:.1f} bytes (all-reduce, ring wire); GFLOP per rank and step: MoE "
            f"{max(m['gflop_per_rank']):.2f} (busiest), dense {d['gflop_per_rank']:.2f}")


def cmd_moe(args, comm, shapes, env) -> int:
    for C, H, L, S, B in shapes:
        r = run_moe_shape(comm, C, S, B, args.moe_experts, args.moe_top_k, args.moe_capacity, args.steps,
                          args.warmup, args.dtype, routing=router_fields(args))
        r["environment"] = env
        rank0_print(print_moe(r), comm=comm)
        if args.json and comm.Get_rank() == 0:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
    return 0
