"""`mpi-tp explain --layer cp`: a live lesson in context parallelism, the ring attention of Z = world size ranks.

    mpiexec -n 2 mpi-tp explain --layer cp                  # S = 4Z positions, two chunks per rank
    mpiexec -n 3 mpi-tp explain --layer cp --seq 12         # 2Z divides S: equal work at every step
    mpiexec -n 2 mpi-tp explain --layer cp --heads 4 --kv-heads 2    # grouped-query attention

Every rank holds two chunks of the sequence (chunk r and chunk 2Z - 1 - r: mpi_tp.parallel.context_parallel)
and runs one causal attention (float64, random q of B sequences and H heads of hs = C / H, k and v of H_kv
heads, each shared by H / H_kv query heads) as ring attention. Rank 0 draws the causal (query, key) grid
with, at each entry, the ring step at which the rank holding that query computes it (rows grouped by rank),
the entries each rank computes at each step beside what a plain split into Z runs would give (the idle
ranks it leaves), and the ring's messages counted on the group "cp" beside the closed form: Z - 1 sends
of K and V forward, Z - 1 of K and V and Z of dK and dV backward, each 2 B H_kv S_r hs values. The output
and the gradients are checked against the serial attention kernel.

It takes --batch, --features, --heads, --kv-heads and --seq (default 4Z); an option of the other lessons,
or a sequence shorter than the 2Z chunks, is refused in one line (plan).
"""
from __future__ import annotations

import numpy
from mpi4py import MPI

from mpi_tp.core import kernels as kern
from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import collective_setup
from mpi_tp.model.config import fewest_heads
from mpi_tp.parallel.context_parallel import ContextSplit
from mpi_tp.parallel.ring_attention import blocks, ring_backward, ring_forward
from mpi_tp.parallel.topology import Topology

# the options of the other lessons (flag, attribute, its value when not given): refused here
OTHER_LESSONS = (("--sequence-parallel", "sequence_parallel", False), ("--micro-batches", "micro_batches", None),
                 ("--vocab", "vocab", None), ("--moe-experts", "moe_experts", None), ("--moe-top-k", "moe_top_k", 2),
                 ("--moe-capacity", "moe_capacity", 1.0), ("--tp", "tp", None))
MARKS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _grid(split, N: int, S: int) -> list[str]:
    """The causal grid: entry (query t, key s <= t) marked with the ring step at which t's rank computes it."""
    step = numpy.full((S, S), -1)
    for r in range(N):
        mine = split.positions_of(r)
        for s in range(N):
            src = (r - s) % N
            keys = split.positions_of(src)
            for rows, cols, diag in blocks(split, src, rank=r):
                for i in range(rows.start, rows.stop):
                    for j in range(cols.start, cols.stop):
                        if keys[j] <= mine[i]:
                            step[mine[i], keys[j]] = s
    owner = {int(p): r for r in range(N) for p in split.positions_of(r)}
    lines = []
    for t in range(S):
        cells = "".join(MARKS[step[t, s]] if s <= t else "." for s in range(S))
        lines.append(f"  query {t:>3} (rank {owner[t]}): {cells}")
    return lines


def _work(split, N: int) -> list[list[int]]:
    """Score entries each rank computes at each ring step, (Z, Z)."""
    return [[sum((rw.stop - rw.start) * (c.stop - c.start) for rw, c, _ in blocks(split, (r - s) % N, rank=r))
             for s in range(N)] for r in range(N)]


def _plain_work(N: int, S: int) -> list[list[int]]:
    """The same for a plain split (rank r the r-th run of S/N positions, whole blocks below the diagonal)."""
    sizes = [S // N + (1 if i < S % N else 0) for i in range(N)]
    return [[sizes[r] * sizes[(r - s) % N] if (r - s) % N <= r else 0 for s in range(N)] for r in range(N)]


def plan(args, N: int) -> dict:
    """The lesson's sizes from the options, checked (a UserError says what to change): B, S, H, H_kv, hs."""
    for flag, name, absent in OTHER_LESSONS:
        if getattr(args, name, absent) != absent:
            raise UserError(f"{flag} does not apply to --layer cp (ring attention at cp = world size), which takes "
                            "--batch, --features, --heads, --kv-heads and --seq: drop it")
    B, C = args.batch, args.features
    S = 4 * N if args.seq is None else args.seq
    for flag, v in (("--features", C), ("--batch", B), ("--seq", S)):
        if v < 1:
            raise UserError(f"{flag} must be a positive integer, got {v}")
    if S < 2 * N:
        raise UserError(f"--seq {S} cannot be cut into 2Z = {2 * N} chunks, two per rank: use --seq {2 * N} or more "
                        f"(the default is 4Z = {4 * N}), or fewer ranks")
    H = fewest_heads(C, 1) if args.heads is None else args.heads
    if H < 1 or C % H:
        raise UserError(f"--heads {H} must divide --features {C} (the head size is C / H)")
    H_kv = H if args.kv_heads is None else args.kv_heads
    if H_kv < 1 or H % H_kv:
        raise UserError(f"--kv-heads {H_kv} must divide the {H} heads (each key/value head serves H / H_kv of them)")
    return {"B": B, "S": S, "H": H, "H_kv": H_kv, "hs": C // H}


def lesson(args, comm) -> bool:
    N = comm.Get_size()
    p = collective_setup(plan, args, N, comm=comm)
    B, S, H, H_kv, HS = p["B"], p["S"], p["H"], p["H_kv"], p["hs"]
    topo = Topology.create(comm, tp=1, cp=N)
    split = ContextSplit(topo.cp, S)
    rng = numpy.random.default_rng(0)
    # grouped: q (B, H_kv, H / H_kv, S, hs), k and v (B, H_kv, 1, S, hs), broadcast over the query heads they serve
    q, dout = (rng.standard_normal((B, H_kv, H // H_kv, S, HS)) for _ in range(2))
    k, v = (rng.standard_normal((B, H_kv, 1, S, HS)) for _ in range(2))
    ref, cache = kern.attention_forward(q, k, v)
    dq, dk, dv = kern.attention_backward(dout, cache)
    mine = split.take                                    # this rank's positions: axis 3
    topo.stats.reset()
    out, c = ring_forward(mine(q, 3), mine(k, 3), mine(v, 3), split)
    forward = topo.stats.snapshot()
    got = ring_backward(mine(dout, 3), c)
    both = topo.stats.snapshot()
    err = max(float(numpy.abs(a - mine(b, 3)).max()) for a, b in zip((out, *got), (ref, dq, dk, dv)))
    ok = bool(comm.allreduce(int(err <= 1e-12), op=MPI.MIN))
    sends = comm.gather((forward.get("cp/send", {}).get("calls", 0), both.get("cp/send", {}).get("calls", 0),
                         both.get("cp/send", {}).get("bytes", 0), split.length()), root=0)
    if comm.Get_rank() == 0:
        kv = f", H_kv = {H_kv} key/value heads (each serves {H // H_kv})" if H_kv != H else ""
        print(f"context parallelism over Z = {N} ranks (the world), float64: B = {B}, H = {H} heads of hs = {HS}{kv}, "
              f"S = {S} positions in 2Z = {2 * N} chunks of {split.sizes}")
        for r in range(N):
            pos = split.positions_of(r).tolist()
            print(f"  rank {r}: chunks {split.chunks(r)}: positions {pos}")
        print("\nthe causal grid (row: a query, column: a key; the mark: the ring step at which the query's rank "
              "computes that score;\nstep 0 with its own keys, step s with rank r - s's, passed along the ring "
              "r -> r + 1):")
        print("\n".join(_grid(split, N, S)))
        work, plain = _work(split, N), _plain_work(N, S)
        print("\nscores computed per ring step (the ring moves at the pace of the busiest rank at each step):")
        for r in range(N):
            print(f"  rank {r}: two ends {work[r]}   plain split {plain[r]}")
        ring = sum(max(w[s] for w in work) for s in range(N))
        flat = sum(max(w[s] for w in plain) for s in range(N))
        print(f"  busiest-rank total: two ends {ring}, plain split {flat} (every score once: {S * (S + 1) // 2}; "
              f"ideal per rank {S * (S + 1) / 2 / N:.1f})")
        print("\nmessages of one layer (counted on the group cp; a message: K and V, or dK and dV, 2 B H_kv S_r hs "
              "float64 values):")
        unit = 2 * B * H_kv * HS * 8                        # bytes of K and V (or dK and dV) per position held
        for r, (f, total, nbytes, length) in enumerate(sends):
            held = [split.length((r - s) % N) for s in range(N)]           # the block held at step s
            closed = unit * (2 * sum(held[:N - 1]) + S) if N > 1 else 0     # one rank: the ring sends nothing
            print(f"  rank {r}: {f} sends forward (Z - 1 = {N - 1}), {total} in all (3Z - 2 = {3 * N - 2}{', none on one rank' if N == 1 else ''}); "
                  f"{nbytes} bytes, closed form 2 B H_kv hs 8 (2 sum_(s<Z-1) S_(r-s) + S) = {closed}: "
                  f"{'equal' if nbytes == closed else 'DIFFERENT'}")
            ok &= nbytes == closed
        print(f"\noutput, dq, dk, dv against the serial attention: max |difference| {err:.2e}: "
              f"{'PASS' if ok else 'FAIL'}")
    topo.free()
    return ok
