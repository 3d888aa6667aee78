"""The check of exercise 4: the student's vocabulary-split embedding against the serial one, V = 37.

V = 37 is prime, so no T >= 2 divides it and the shards always differ by one row.
The ids cover every token once (and a few twice), so a row held by two ranks or
by none shows up as a wrong vector for that token id.
"""
from __future__ import annotations

import numpy

from mpi_tp.core.testing import all_true
from mpi_tp.course.common import (
    F64,
    RTOL,
    SEED,
    C,
    Feedback,
    build,
    describe,
    finish,
    needs_ranks,
)
from mpi_tp.model.parallel_embedding import VocabParallelEmbedding
from mpi_tp.parallel.topology import Topology, offsets, split_sizes

V = 37
B, S = 2, 20              # 40 token ids: every one of the V, three of them twice
UNIT = B * S * C * 8


def _ids():
    rng = numpy.random.default_rng(SEED)
    ids = numpy.concatenate([numpy.arange(V), rng.integers(0, V, B * S - V)])
    return rng.permutation(ids).reshape(B, S)


def _ranges_text(ranges) -> str:
    return ", ".join(f"rank {i} [{a}, {b})" for i, (a, b) in enumerate(ranges))


def _rule(T: int) -> list[tuple[int, int]]:
    """Every rank's rows [V_start, V_start + V_i) by the split rule."""
    sizes = split_sizes(V, T)
    return [(o, o + n) for o, n in zip(offsets(sizes), sizes)]


def _check_ranges(fb: Feedback, ranges, T: int) -> list[int]:
    """Rank 0 compares every rank's rows with the split rule and says which token ids are held twice or never
    (a statement about every rank, so no rank prefix); returns the ids held by no rank."""
    rule = _rule(T)
    if fb.rank != 0 or ranges == rule:
        return []
    fb.problem(f"the rows [V_start, V_start + V_i) of the ranks are {_ranges_text(ranges)}; the split rule "
               f"gives {_ranges_text(rule)}", every_rank=True)
    held = numpy.zeros(V, dtype=int)
    for a, b in ranges:
        held[max(a, 0):max(min(b, V), 0)] += 1
    twice, never = numpy.flatnonzero(held > 1).tolist(), numpy.flatnonzero(held == 0).tolist()
    if twice:
        fb.note(f"token ids {twice} are held by two ranks: g adds their row twice")
    if never:
        fb.note(f"token ids {never} are held by no rank: they come out as zeros")
    fb.note(f"V = {V} does not divide by T = {T}: V_i is {V // T} or {V // T + 1}, and V_start of rank i "
            f"is the sum of the V_i of the ranks before it")
    return never


def _check_lookup(fb: Feedback, ids, y, y_ref, said_zeros=()) -> None:
    """Which token ids come out wrong (the output is whole and the same on every rank: rank 0 says it);
    zeros are named unless `said_zeros` (the ids no rank holds, already named) covers them."""
    if fb.rank != 0 or y.shape != y_ref.shape:
        return
    bad = numpy.abs(y - y_ref).max(axis=-1) > RTOL * float(numpy.abs(y_ref).max())
    wrong = sorted(set(ids[bad].tolist()))
    if wrong:
        zeros = sorted(set(ids[bad & (numpy.abs(y).max(axis=-1) == 0)].tolist()))
        zeros = zeros if set(zeros) - set(said_zeros) else []
        fb.note(f"wrong vectors for token ids {wrong} ({len(wrong)} of {V})"
                + (f"; ids {zeros} come out as zeros" if zeros else ""))


def vocab_offset(student, comm, path=None) -> bool:
    """Exercise 4: Embedding at T = world size against VocabParallelEmbedding on one rank."""
    T = comm.Get_size()
    needs_ranks(4, T)
    topo, serial = Topology.create(comm), Topology.serial()
    fb = Feedback(topo.tp.rank, path)
    par, ok = fb.attempt("Embedding(...)", build, lambda: student.Embedding("wte", V, C, topo.tp, F64, SEED))
    ser = build(lambda: VocabParallelEmbedding("wte", V, C, serial.tp, F64, seed=SEED))
    expect = {"forward": {"tp/all_reduce": (1, UNIT)}, "backward": {}}
    if ok and not hasattr(par, "weight"):
        fb.problem("Embedding has no weight: keep self.weight, the table's rows on this rank (a Param)")
        ok = False
    if all_true(ok, comm):
        w = par.weight
        never = _check_ranges(fb, comm.allgather((int(w.start), int(w.stop))), T)   # a few ints: pickled once
        ids, dout = _ids(), numpy.random.default_rng(SEED + 1).standard_normal((B, S, C))
        y_ref = ser.forward(ids)
        ser.backward(dout)
        counters, y = {}, None
        for phase, fn, arg in (("forward", par.forward, ids), ("backward", par.backward, dout)):
            topo.stats.reset()
            out, ok = fb.attempt(phase, fn, arg.copy())
            if not all_true(ok, comm):
                break
            counters[phase], y = topo.stats.snapshot(), out if phase == "forward" else y
        else:
            if fb.compare("output wte[ids] (B, S, C)", y, y_ref) > RTOL:
                _check_lookup(fb, ids, y, y_ref, never)
            if 0 <= w.start < w.stop <= V:
                scale = float(numpy.abs(ser.weight.grad).max())
                fb.compare(f"gradient of {w.name} (rows [{w.start}, {w.stop}))", w.grad,
                           ser.weight.grad[w.index()], scale)
            for phase in ("forward", "backward"):
                fb.counters(phase, counters[phase], expect[phase], UNIT)
            fb.facts.append(f"rows: {_ranges_text(_rule(T))} of V = {V}; output and table gradient equal "
                            "the serial embedding")
            fb.facts.append(f"collectives: forward {describe(expect['forward'], UNIT)}; backward none")
    topo.free()
    serial.free()
    return finish(comm, 4, "uneven vocabulary shards and their offset", fb, [
        ("mpi_tp.parallel.topology.split_sizes and offsets give every rank's V_i and V_start; "
         "rank i starts after the rows of ranks 0 ... i-1, not at i (V // T)"),
        "docs/learn.md, sections 4 (uneven shards) and 5 (the vocabulary)"])
