"""`mpi-tp explain --layer moe`: a live lesson in expert parallelism, one mixture-of-experts layer
split over the ranks of the job.

    mpiexec -n 2 mpi-tp explain --layer moe                           # ep = 2: 4 experts, 2 per rank
    mpiexec -n 3 mpi-tp explain --layer moe --moe-top-k 1 --moe-capacity 0   # 4 experts: 2 + 1 + 1, dropless
    mpiexec -n 4 mpi-tp explain --layer moe --tp 2                    # T = 2 inside each of ep = 2 replicas
    mpiexec -n 2 mpi-tp explain --layer moe --moe-dispatcher allgather   # every row to every rank instead
    mpiexec -n 2 mpi-tp explain --layer moe --moe-router sigmoid --moe-gate-scale 2.5   # DeepSeek-V3's gates

Builds one MoEMLP (float64, random weights) at T = --tp (default 1) and
ep = D = world size / T: each replica holds B sequences of S tokens of its
own, routes them (the top k of E experts, a capacity per sequence), sends each
admitted (token, expert) row to the rank holding that expert and gets its
result back (all-to-all), then runs the backward pass. Rank by rank it prints
the routing (token, chosen experts, gates, admitted or dropped), the experts
the rank holds, the collectives it counted beside the formula (rows leaving
the rank x C x itemsize, worked out from every replica's routing), and how far
the output, the input gradient and the parameter gradients are from the same
layer on one rank over the whole batch (same seed and names: expert e has the
same weights wherever it lives). Exit status 0 when everything matches.

The router options (--moe-router, --moe-topk-norm, --moe-gate-scale,
--moe-drop-policy, --moe-shared-experts; mpi_tp.model.routing) are the model
config's: the printed gates are the chosen router's, and a line after each
table gives the range of their sums per token (1 only when normalised and
unscaled). The bytes each dispatcher should count: mpi_tp.commands.moe_common.
"""
from __future__ import annotations

import math
import textwrap

import numpy
from mpi4py import MPI

from mpi_tp.commands.explain.common import comm_text, formula_text, wire_bytes
from mpi_tp.commands.explain.moe_texts import DENSE, DROPS, LESSON, ROLES, router_text
from mpi_tp.commands.moe_common import add_router_arguments, expected_counters, router_fields
from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import collective_setup, rank0_print
from mpi_tp.core.testing import all_true, max_rel_diff, randomize
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.moe import MoEMLP
from mpi_tp.model.routing import normalises, route
from mpi_tp.parallel.expert_parallel import expert_of
from mpi_tp.parallel.layout import Layout
from mpi_tp.parallel.topology import Topology, offsets, split_sizes

F64 = numpy.float64
SEED = 7
RTOL = 1e-10                  # float64: the parallel layer only moves rows and reorders sums
AUX_WEIGHT, Z_WEIGHT = 0.01, 0.001

def add_arguments(e) -> None:
    e.add_argument("--moe-experts", type=int, default=None,
                   help="with --layer moe: experts E (default 4); with --layer step: make block 1 an MoE block")
    e.add_argument("--moe-top-k", type=int, default=2,
                   help="with --layer moe (or step): experts per token k (default 2)")
    e.add_argument("--moe-capacity", type=float, default=1.0,
                   help="with --layer moe (or step): capacity factor per sequence and expert (default 1.0; "
                        "0: dropless)")
    add_router_arguments(e, "with --layer moe")
    e.add_argument("--moe-shared-experts", type=int, default=0,
                   help="with --layer moe: shared experts every token goes through beside its k routed ones "
                        "(DeepSeek), one MLP that many experts wide, replicated over ep (default 0)")
    e.add_argument("--tp", type=int, default=None,
                   help="with --layer moe: tensor-parallel size inside each replica (default 1; ep = ranks / T)")


def plan(args, world: int) -> dict:
    """The lesson's sizes, checked against the world size (a UserError says what to change)."""
    E = 4 if args.moe_experts is None else args.moe_experts
    k, capacity, tp = args.moe_top_k, args.moe_capacity, 1 if args.tp is None else args.tp
    C, B, S = args.features, args.batch, args.seq
    for flag, v in (("--features", C), ("--batch", B), ("--seq", S), ("--moe-experts", E), ("--tp", tp)):
        if v < 1:
            raise UserError(f"{flag} must be a positive integer, got {v}")
    if args.moe_shared_experts < 0:
        raise UserError(f"--moe-shared-experts must be an integer >= 0, got {args.moe_shared_experts}")
    ep = Layout.resolve(world, tp=tp, dp=0).dp            # ep = dp = ranks / T (the world-size rule's own line)
    if E < ep:
        raise UserError(f"--moe-experts {E} cannot be divided among ep = {ep} ranks (some rank would hold none): "
                        f"use --moe-experts {ep} or more, or a larger --tp")
    if not 1 <= k <= E:
        raise UserError(f"--moe-top-k {k} must be between 1 and --moe-experts {E}")
    if not 0 <= capacity < math.inf:
        raise UserError(f"--moe-capacity must be a finite number >= 0 (0: dropless), got {capacity}")
    if 4 * C < tp:
        raise UserError(f"an expert's width 4C = {4 * C} cannot be split over --tp {tp}: use --features {tp} or more")
    cfg = GPTConfig(vocab_size=1, block_size=S, n_layer=1, n_head=1, n_embd=C, moe_experts=E, moe_top_k=k,
                    moe_capacity=capacity, moe_aux_weight=AUX_WEIGHT, moe_z_weight=Z_WEIGHT,
                    moe_shared_experts=args.moe_shared_experts, **router_fields(args))
    cfg.validate(1, ep)                        # a ConfigError (a UserError): e.g. topk-softmax with norm none
    cap = math.ceil(round(capacity * S * k / E, 9)) if capacity else None
    return {"cfg": cfg, "B": B, "S": S, "C": C, "E": E, "k": k, "tp": tp, "ep": ep, "cap": cap}


def _table(x, layer, routing, first_seq: int, k: int) -> list[str]:
    """One line per token of this replica: global index, (sequence, position), each choice's gate and fate;
    then the range of the gates' sums per token (what the router options make of them)."""
    B, S, C = x.shape
    r = route(x.reshape(B * S, C) @ layer.router.data, k, layer.router_kind, layer.topk_norm, layer.gate_scale)
    choice, gate = r.choice, r.gate
    lines = [("  token  seq pos  " + "".join(f"{f'choice {j + 1}':<19}" for j in range(k))).rstrip()]
    for n in range(B * S):
        b, t = divmod(n, S)
        cells = [f"e{int(choice[n, j])} {float(gate[n, j]):.3f} {'kept' if routing[1][b, t, j] else 'DROPPED'}"
                 for j in range(k)]
        picks = "".join(f"{cell:<19}" for cell in cells)
        lines.append(f"  {(first_seq + b) * S + t:5d}  {first_seq + b:3d} {t:3d}  {picks.rstrip()}")
    sums = gate.sum(axis=1)
    lines.append(f"  gates per token sum to {float(sums.min()):.3f} .. {float(sums.max()):.3f} ({layer.router_kind} "
                 f"router, {'normalised' if normalises(layer.router_kind, layer.topk_norm, k) else 'not normalised'}"
                 f", scale {layer.gate_scale:g})")
    return lines


def _comm_lines(phase, snapshot, formula, world, G) -> list[str]:
    """One line per collective of one pass: counted, beside the formula of its buffer bytes. G: group -> size."""
    if not snapshot:
        return [f"  {phase:<9} none" + (" (one rank: every expert is here)" if world == 1 else "")]
    lines = []
    for key, v in snapshot.items():
        nbytes = formula["expect"].get((phase, key), (None, None))[1]
        said = (f" (buffer = {formula['why'][(phase, key)]} = {nbytes})" if (phase, key) in formula["why"]
                else " (unexpected)")
        lines.append(f"  {phase:<9} {comm_text(key, v)}{said}; wire bytes = {formula_text(key.split('/')[1], G[key])}"
                     f"  ({ROLES.get((phase, key), '')})")
    return lines


def lesson(args, comm) -> bool:
    """Run the lesson on every rank, print it from rank 0; True when every check passed."""
    p = collective_setup(plan, args, comm.Get_size(), comm=comm)
    cfg, B, S, C, E, k, tp, ep = (p[key] for key in ("cfg", "B", "S", "C", "E", "k", "tp", "ep"))
    world = comm.Get_size()
    sizes = split_sizes(E, ep)
    n_shared = cfg.moe_shared_experts
    shared = (f"; + {n_shared} shared expert{'s' * (n_shared > 1)} (one MLP {n_shared} x 4C wide that every token "
              f"goes through, replicated over ep, split over tp)" if n_shared else "")
    cap = (f"cap = ceil({cfg.moe_capacity:g} x S x k / E) = {p['cap']} assignments per sequence and expert"
           if p["cap"] else "dropless (capacity 0)")
    rank0_print(f"mixture of experts: E = {E} experts, top-k = {k}, {cap}; T = {tp}, D = ep = {ep} "
                f"replica{'s' * (ep > 1)} of B = {B} sequence{'s' * (B > 1)} x S = {S} tokens; C = {C}, "
                f"F = 4C = {4 * C} per expert{shared}; float64; aux weight {AUX_WEIGHT}, z weight {Z_WEIGHT}\n"
                f"experts by ep rank: " + "; ".join(
                    f"rank {r}: " + " ".join(f"e{e}" for e in range(o, o + n))
                    for r, (o, n) in enumerate(zip(offsets(sizes), sizes))) +
                f"\n{router_text(cfg)}; past the capacity: {DROPS[cfg.moe_drop_policy]}"
                f"\n\n== moe ==\n{textwrap.fill(LESSON.format(drop=DROPS[cfg.moe_drop_policy]), 100)}", comm=comm)
    topo, serial = Topology.create(comm, tp=tp, dp=ep, ep=ep), Topology.serial()
    par, ser = MoEMLP("moe", cfg, topo, F64, SEED), MoEMLP("moe", cfg, serial, F64, SEED)
    randomize(par, seed=SEED)                  # the same values slice for slice, whoever holds the expert
    randomize(ser, seed=SEED)
    rng = numpy.random.default_rng(SEED)
    x, dout = rng.standard_normal((B * ep, S, C)), rng.standard_normal((B * ep, S, C))   # the global batch
    mine = topo.replica_rows(B)
    y_ref = ser.forward(x)
    dx_ref = ser.backward(dout)
    par.loss_scale = 1.0 / ep                  # each replica's aux and z-loss are means over its own batch
    topo.stats.reset()
    y = par.forward(numpy.ascontiguousarray(x[mine]))
    fwd = topo.stats.snapshot()
    topo.stats.reset()
    dx = par.backward(numpy.ascontiguousarray(dout[mine]))
    bwd = topo.stats.snapshot()

    # Against the serial layer: the gradients of what every replica holds (the router, the shared experts)
    # are summed over the replicas, as the reducer would (the router's, from each rank's own positions, over tp
    # too: Param.sp_partial); an expert's copy has seen all its tokens already.
    summed = {}
    for q in par.parameters():
        if expert_of(q) is None:
            summed[q.name] = q.grad.copy()
            topo.dp.comm.Allreduce(MPI.IN_PLACE, summed[q.name])
            if q.sp_partial:
                topo.tp.comm.Allreduce(MPI.IN_PLACE, summed[q.name])
    reference = {q.name: q for q in ser.parameters()}
    scale = max(float(numpy.abs(q.grad).max()) for q in ser.parameters())
    grads = {q.name: max_rel_diff(summed.get(q.name, q.grad), reference[q.name].grad[q.index()], scale)
             for q in par.parameters()}
    worst = max(grads, key=grads.get)
    err_out, err_in = max_rel_diff(y, y_ref[mine]), max_rel_diff(dx, dx_ref[mine])
    aux = topo.dp.comm.allreduce(par.stats["aux_loss"]) / ep
    err_aux = abs(aux - ser.stats["aux_loss"]) / abs(ser.stats["aux_loss"])

    own = tuple(a[:, par._owners.positions] for a in par.routing)      # the positions this rank routed
    routes = topo.ep.comm.allgather(own)                      # a lesson: pickled once
    me, local = topo.ep.rank, list(par.dispatcher.local)
    rows = {e: sum(int((a & (c == e)).sum()) for c, a in routes) for e in local}
    formula = expected_counters(routes, E, me, C, 8, cfg.moe_dispatcher, tp, topo.tp.comm.allreduce(sum(rows.values())),
                                B * S if n_shared else 0, (B, S, k))
    G = {f"{g.name}/{k}": g.size for g in (topo.ep, topo.tp)
         for k in ("all_to_all", "all_to_allv", "all_reduce", "all_gather_counts", "all_gather", "reduce_scatter", "routing",
                   "routing_sums", "expert_counts", "etp_counts", "etp_gather", "etp_reduce")}
    counted = {(phase, key): (v["calls"], v["bytes"]) for phase, snap in (("forward", fwd), ("backward", bwd))
               for key, v in snap.items()}
    sizes = {key: G[key] for snap in (fwd, bwd) for key in snap}
    bytes_ok = counted == formula["expect"] and all(
        v["wire_bytes"] == round(wire_bytes(key.split("/")[1], v["bytes"], sizes[key])) for snap in (fwd, bwd)
        for key, v in snap.items())
    ok = max(err_out, err_in, grads[worst], err_aux) <= RTOL and bytes_ok

    ex = par.experts[0]
    seqs = f"sequence {mine.start}" if B == 1 else f"sequences {mine.start}-{mine.stop - 1}"
    lines = [(f"-- rank {comm.Get_rank()} of {world}: ep rank {me}, tp rank {topo.tp.rank}; replica {topo.dp.rank}: "
              f"{seqs} of the global batch --"),
             (f"  holds experts {', '.join(f'e{e}' for e in local)} (E_i = {len(local)} of {E}); each: fc "
              f"{ex.fc_weight.global_shape} -> shard {tuple(ex.fc_weight.data.shape)}, proj "
              f"{ex.proj_weight.global_shape} -> shard {tuple(ex.proj_weight.data.shape)}; router "
              f"{par.router.global_shape} whole (every rank)")]
    if topo.tp.rank == 0:
        lines += _table(x[mine], par, par.routing, mine.start, k)
    else:
        lines.append("  tokens and routing: those of tp rank 0 of this replica (the same whole-sequence routing; "
                     f"this rank routed positions {par._owners.positions.min()}-{par._owners.positions.max()})")
    kept = int(par.routing[1].sum())
    lines.append(f"  assignments B S k = {B * S * k}: {kept} admitted, {B * S * k - kept} dropped; rows out to "
                 f"other ep ranks {formula['out']}, rows in from them {formula['back']}; rows per local expert: "
                 + ", ".join(f"e{e} {n}" for e, n in rows.items()))
    lines += _comm_lines("forward", fwd, formula, world, G) + _comm_lines("backward", bwd, formula, world, G)
    lines.append(f"  counted buffer bytes = formula, wire bytes = closed form: {'yes' if bytes_ok else 'NO'}")
    lines.append(f"  vs serial: output {err_out:.1e}, dinp {err_in:.1e}, param grads {grads[worst]:.1e} (worst "
                 f"{worst}), aux loss {aux:.6f} (mean over replicas) vs {ser.stats['aux_loss']:.6f}; tolerance "
                 f"{RTOL:.0e}: {'PASS' if ok else 'FAIL'}")
    texts = comm.gather("\n".join(lines), root=0)
    every = all_true(ok, comm)

    per_expert = numpy.zeros(E, dtype=int)
    for c, a in topo.ep.comm.allgather(par.routing):          # whole sequences, every replica
        per_expert += numpy.bincount(c[a], minlength=E)
    N = B * S * ep
    sent = comm.gather(sum(v["bytes"] for key, v in fwd.items() if key.startswith("ep/")), root=0)
    if comm.Get_rank() == 0:
        mean_sent = sum(sent) / len(sent)
        dense = N * C * 8
        print("\n".join(texts))
        counts = ", ".join(f"e{e} {n}" for e, n in enumerate(per_expert))
        print(f"\ntokens per expert (admitted, all replicas): {counts}"
              f"; max/mean {per_expert.max() / per_expert.mean():.2f}; dropped {N * k - per_expert.sum()} of {N * k} "
              f"assignments (the same ones at every layout: capacity is per sequence)")
        print(f"\n{textwrap.fill(DENSE, 100)}\nOn these N = {N} tokens: the dense MLP at T = {world} all-reduces "
              f"(N, C) = {dense} bytes forward and {dense} backward on every rank (ring: {2 * (world - 1) / world:.2f}"
              f" x that on the wire); here a rank sent {mean_sent:.0f} bytes forward on average "
              f"({cfg.moe_dispatcher.replace('allgather', 'all-gather').replace('alltoall', 'all-to-all')} "
              f"{'rows and counts' if ep > 1 else ': none, one rank'}).")
        print(f"moe: all ranks equal the serial layer: {'yes' if every else 'no'}")
    topo.free()
    serial.free()
    return every
