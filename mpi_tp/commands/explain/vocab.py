"""`mpi-tp explain --layer embedding` and `--layer loss`: the vocabulary split, rank by rank.

    mpiexec -n 3 mpi-tp explain --layer embedding               # V = 11 rows: 4 + 4 + 3
    mpiexec -n 2 mpi-tp explain --layer loss --vocab 9          # 5 + 4 vocabulary columns of the logits
    mpiexec -n 2 mpi-tp explain --layer embedding --sequence-parallel

The token table wte (V, C) is cut by rows: rank i holds V_i rows from offset
V_start (split_sizes: the first V % T ranks hold one more; an odd V makes the
shards differ). The embedding looks up the tokens in its rows, writes zeros for
the others, and g all-reduces (under sequence parallelism: a reduce-scatter
that keeps rank i's S_i positions). The loss (vocab-parallel cross entropy)
never gathers the logits: an all-reduce MAX of the N = B S row maxima, then one
all-reduce of 2N sums (sum of exponentials and target logit, fused), and a
backward with no communication. Both run in float64 against the serial layer
(tolerance 1e-10), and the loss lesson shows numerically why the max needs no
backward.
"""
from __future__ import annotations

import textwrap

import numpy

from mpi_tp.commands.explain.common import comm_text, formula_text, wire_bytes
from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import collective_setup, rank0_print
from mpi_tp.core.testing import all_true, max_rel_diff, randomize
from mpi_tp.model.parallel_cross_entropy import VocabParallelCrossEntropy
from mpi_tp.model.parallel_embedding import VocabParallelEmbedding
from mpi_tp.parallel.sequence_parallel import SequenceSplit
from mpi_tp.parallel.topology import Topology, shard_range
from mpi_tp.parallel.trace import Trace

LAYERS = ("embedding", "loss")
RTOL = 1e-10
F64 = numpy.float64
SEED = 7

LESSONS = {
    "embedding": "VocabParallelEmbedding: the table wte (V, C) is cut by rows, wte = [wte_0; ...; wte_{T-1}], "
                 "rank i holding the V_i rows of the tokens V_start ... V_start + V_i - 1. Each rank looks up "
                 "the tokens that fall in its rows and writes zeros for the rest (the mask), so exactly one "
                 "rank contributes each position's row; g all-reduces the (B, S, C) partial sums. Backward: no "
                 "communication, each rank adds dY of its own tokens into its rows (the mask again).",
    "loss": "VocabParallelCrossEntropy: rank i holds the logits of its V_i vocabulary columns (the tied output "
            "layer x wte_i^T) and never sees the others. With l the logits, y the targets and j a position (row): "
            "loss_j = log sum_v exp(l_jv - m_j) - (l_j,y_j - m_j) needs three things over the whole vocabulary: "
            "m_j, the row maximum (an all-reduce MAX of each rank's row maxima, N values), the sum of "
            "exp(l_jv - m_j) and the target's shifted logit (only its "
            "owner adds it, the others add 0), fused in one all-reduce SUM of 2N values. Backward: dlogits = "
            "(softmax - onehot) / N on rank i's own columns: no communication at all.",
}
SP_EMBEDDING = ("VocabParallelEmbedding under sequence parallelism: the lookup is the same, but g becomes a "
                "reduce-scatter: sum the partial rows and keep rank i's S_i positions; backward, an all-gather "
                "of dY's positions before each rank adds its own tokens' rows.")
MAX_NOTE = ("Why the max all-reduce has no backward: m_j is subtracted only to keep exp() from overflowing. "
            "Replacing m_j by m_j + c_j for any c_j leaves the loss unchanged, since the same c_j comes out of "
            "the log and out of the target logit; so d loss / d m_j = 0, and the backward may treat m_j as a "
            "constant. Numerically, on this batch:")


def add_arguments(e) -> None:
    e.add_argument("--vocab", type=int, default=None,
                   help="with --layer embedding or loss: vocabulary size V (default 11, odd: the shards differ)")


def plan(args, T: int) -> dict:
    V, B, S, C = 11 if args.vocab is None else args.vocab, args.batch, args.seq, args.features
    if V < 1:
        raise UserError(f"--vocab must be a positive integer, got {V}")
    if V < T:
        raise UserError(f"--vocab {V} cannot be split over {T} ranks (each needs a row): use --vocab {T} or more")
    return {"V": V, "B": B, "S": S, "C": C}


def _shifted(logits, targets, shift):
    """Serial cross entropy (mean loss, dlogits) with the max m_j replaced by m_j + shift_j, m held constant."""
    l = logits.reshape(-1, logits.shape[-1])
    m = l.max(axis=1) + shift
    e = numpy.exp(l - m[:, None])
    y = targets.reshape(-1)
    rows = numpy.arange(len(y))
    loss = numpy.log(e.sum(axis=1)) - (l[rows, y] - m)
    d = e / e.sum(axis=1, keepdims=True)
    d[rows, y] -= 1
    return float(loss.mean()), d / len(y)


def _calls(events: list, T: int, roles: list[str]) -> list[str]:
    """One line per collective call (trace events, in order), with its closed form and its role."""
    lines = []
    for k, e in enumerate(events):
        n, kind = e["args"]["bytes"], e["name"].split("/", 1)[1]
        lines.append(f"    call {k}: {e['name']}, {n} buffer bytes, {round(wire_bytes(kind, n, T))} wire bytes "
                     f"= {formula_text(kind, T)}  ({roles[k] if k < len(roles) else 'unexpected'})")
    return lines


def _run(kind: str, p: dict, comm, sequence_parallel: bool) -> tuple[bool, str, list]:
    """This rank's lesson of `kind`: (equal to the serial layer?, its text, the max note's lines)."""
    V, B, S, C = p["V"], p["B"], p["S"], p["C"]
    topo, serial = Topology.create(comm), Topology.serial()
    T = topo.tp.size
    rng = numpy.random.default_rng(SEED)
    targets = rng.integers(0, V, (B, S))
    sp = SequenceSplit(topo.tp, S) if sequence_parallel and kind == "embedding" else None   # the pass's cut
    if kind == "embedding":
        par = VocabParallelEmbedding("wte", V, C, topo.tp, F64, seed=SEED)
        ser = VocabParallelEmbedding("wte", V, C, serial.tp, F64, seed=SEED)
        randomize(par, SEED)
        randomize(ser, SEED)
        start, stop = par.start, par.stop
        dout = rng.standard_normal((B, S, C))
        pos = slice(None)
        if sp is not None:
            pos = sp.positions
        y_ref = ser.forward(targets)
        ser.backward(dout)
    else:
        logits = 3 * rng.standard_normal((B, S, V))
        _, start, stop = shard_range(V, topo.tp, None, "the vocabulary")      # as the GPT ties them
        par, ser = VocabParallelCrossEntropy(topo.tp, start, stop), VocabParallelCrossEntropy(serial.tp, 0, V)
        loss_ref = ser.forward(logits, targets)
        dl_ref = ser.backward(1.0)
    topo.stats.reset()
    topo.stats.trace = trace = Trace(None)
    if kind == "embedding":
        y = par.forward(targets, sp)
        fwd, n_fwd = topo.stats.snapshot(), len(trace.events)
        topo.stats.reset()
        par.backward(numpy.ascontiguousarray(dout[:, pos]))
        errs = {"output": max_rel_diff(y, y_ref[:, pos]), "rows' grad": max_rel_diff(par.weight.grad,
                                                                                    ser.weight.grad[start:stop])}
    else:
        loss = par.forward(numpy.ascontiguousarray(logits[..., start:stop]), targets)
        fwd, n_fwd = topo.stats.snapshot(), len(trace.events)
        topo.stats.reset()
        dl = par.backward(1.0)
        errs = {"loss": abs(loss - loss_ref) / abs(loss_ref), "dlogits": max_rel_diff(dl, dl_ref[..., start:stop])}
    bwd = topo.stats.snapshot()
    topo.stats.trace = None
    events = {"forward": trace.events[:n_fwd], "backward": trace.events[n_fwd:]}
    N = B * S
    if kind == "embedding":
        here = int(((targets >= start) & (targets < stop)).sum())
        roles = {"forward": ["g: sum the partial rows (only the owner of a token adds a non-zero row)"
                             if sp is None else "sp's g: sum the partial rows, keep this rank's S_i positions"],
                 "backward": ["sp's g backward: gather dY's positions"]}
        lines = [(f"  wte/weight: global ({V}, {C}) -> shard ({stop - start}, {C}) = [{start}:{stop}, :]: "
                  f"tokens {start} ... {stop - 1}, V_i = {stop - start}"),
                 f"  looks up {here} of the N = {N} positions, writes zeros at the other {N - here}",
                 f"  input {targets.shape} token ids -> output {y.shape}"]
        want = {"forward": [(("tp/all_reduce" if sp is None else "tp/reduce_scatter"), N * C * 8)],
                "backward": [] if sp is None else [("tp/all_gather", N * C * 8)]}
    else:
        here = int(((targets >= start) & (targets < stop)).sum())
        roles = {"forward": [f"MAX of the ranks' row maxima: m_j for the N = {N} positions",
                             (f"SUM of [sum_v exp(l_jv - m_j); l_j,y_j - m_j], 2N = {2 * N} values (this rank "
                              f"owns {here} of the N targets)")], "backward": []}
        lines = [(f"  logits: global ({B}, {S}, {V}) -> this rank's columns ({B}, {S}, {stop - start}) = "
                  f"[..., {start}:{stop}], V_i = {stop - start}")]
        want = {"forward": [("tp/all_reduce", N * 8), ("tp/all_reduce", 2 * N * 8)], "backward": []}
    if T == 1:
        want = {"forward": [], "backward": []}
    ok_counts = True
    for phase, snap in (("forward", fwd), ("backward", bwd)):
        expect = {}
        for key, n in want[phase]:
            c = expect.setdefault(key, {"calls": 0, "bytes": 0, "wire_bytes": 0.0})
            c["calls"], c["bytes"] = c["calls"] + 1, c["bytes"] + n
            c["wire_bytes"] += wire_bytes(key.split("/")[1], n, T)
        ok_counts &= {k: (v["calls"], v["bytes"], v["wire_bytes"]) for k, v in snap.items()} == \
            {k: (v["calls"], v["bytes"], round(v["wire_bytes"])) for k, v in expect.items()}
        if not snap:
            lines.append(f"  {phase:<9} none" + (" (one rank: nothing to communicate)" if T == 1 else ""))
        for key, v in snap.items():
            lines.append(f"  {phase:<9} {comm_text(key, v)}")
        lines += _calls(events[phase], T, roles[phase])
    numbers, shift_ok = _max_note(logits, targets) if kind == "loss" else ([], True)
    worst = max(errs.values())
    ok = worst <= RTOL and ok_counts and shift_ok
    lines.append(f"  counted bytes = closed forms: {'yes' if ok_counts else 'NO'}")
    lines.append("  vs serial: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) +
                 f"; tolerance {RTOL:.0e}: {'PASS' if ok else 'FAIL'}")
    topo.free()
    serial.free()
    return ok, "\n".join(lines), numbers


def _max_note(logits, targets) -> tuple[list[str], bool]:
    """The numbers behind MAX_NOTE, and whether they show what it says (shifted m: same loss and dlogits)."""
    base, d0 = _shifted(logits, targets, 0.0)
    c = 5 * numpy.random.default_rng(SEED + 1).standard_normal(targets.size)
    moved, d1 = _shifted(logits, targets, c)
    h = 1e-3
    up, _ = _shifted(logits, targets, numpy.full(targets.size, h))
    down, _ = _shifted(logits, targets, numpy.full(targets.size, -h))
    slope = (up - down) / (2 * h)
    same = abs(moved - base) <= RTOL * abs(base) and max_rel_diff(d1, d0) <= RTOL and abs(slope) <= RTOL
    return [(f"  loss with m_j: {base:.15f}; with m_j + c_j (c_j random, up to {abs(c).max():.1f}): {moved:.15f}; "
             f"dlogits differ by {numpy.abs(d1 - d0).max():.1e}"),
            (f"  d loss / d m by central differences (m_j + {h} vs m_j - {h}): {slope:.1e}; the max needs no "
             f"backward: {'yes' if same else 'NO'}")], same


def lesson(kind: str, args, comm) -> bool:
    """Print the lesson of `kind` (embedding or loss) from rank 0; True when every rank passed."""
    p = collective_setup(plan, args, comm.Get_size(), comm=comm)
    sp = bool(getattr(args, "sequence_parallel", False))
    if sp and kind == "embedding" and p["S"] < comm.Get_size():
        raise UserError(f"--sequence-parallel cuts --seq {p['S']} over {comm.Get_size()} ranks: use --seq "
                        f"{comm.Get_size()} or more")
    ok, text, numbers = _run(kind, p, comm, sp)
    texts = comm.gather(text, root=0)              # a lesson, not a hot path: pickled once
    every = all_true(ok, comm)
    T = comm.Get_size()
    head = SP_EMBEDDING if sp and kind == "embedding" else LESSONS[kind]
    if sp and kind == "loss":
        head += (" Under sequence parallelism nothing changes here: the output layer's all-gather has given every "
                 "rank all S positions of its V_i columns.")
    note = "".join(f"\n{line}" for line in [textwrap.fill(MAX_NOTE, 100)] + numbers) if numbers else ""
    body = "\n".join(f"-- rank {r} of {T} --\n{t}" for r, t in enumerate(texts or []))
    rank0_print(f"\n== {kind} ==\nV = {p['V']} tokens over T = {T} rank{'s' * (T > 1)}, N = B S = "
                f"{p['B'] * p['S']} positions, C = {p['C']}\n{textwrap.fill(head, 100)}\n{body}{note}\n"
                f"{kind}: all ranks equal the serial layer: {'yes' if every else 'no'}", comm=comm)
    return every
