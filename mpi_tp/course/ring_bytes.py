"""The check of exercise 6: the student's formulas for one layer's ring attention, against a real ring.

One causal attention of context parallelism at Z = world size (mpi_tp.parallel.ring_attention: ring_forward,
then ring_backward), measured at two shapes: S = 13 in float64 (2Z never divides it: uneven chunks) and a
grouped-query one in float32 (H = 4 query heads, H_kv = 1 key/value head). Against the counters of the group
"cp" (its sends, forward and backward, and their bytes) go messages(Z) and sent_bytes(B, H, H_kv, S, hs, Z, r,
itemsize); against the blocks the ring really computes at each step (each computed block passes through the
ring's mask_of hook, here a mask that keeps everything) goes scores(S, Z, r, s).
"""
from __future__ import annotations

import numbers

import numpy

from mpi_tp.core.errors import UserError
from mpi_tp.course.common import SEED, Feedback, finish, needs_ranks
from mpi_tp.parallel.context_parallel import ContextSplit
from mpi_tp.parallel.ring_attention import ring_backward, ring_forward
from mpi_tp.parallel.topology import Topology, split_sizes

# (B, H, H_kv, S, hs, dtype): uneven chunks; grouped-query attention in float32
SHAPES = ((2, 2, 2, 13, 4, numpy.float64), (3, 4, 1, 16, 4, numpy.float32))
MAX_Z = min(s[3] for s in SHAPES) // 2           # two chunks a rank


def measure(topo: Topology, B: int, H: int, H_kv: int, S: int, hs: int, dtype):
    """(forward sends, backward sends, bytes sent, entries computed at each ring step) of this rank, for one
    ring_forward and ring_backward over the cp group."""
    split = ContextSplit(topo.cp, S)
    Z, r = topo.cp.size, topo.cp.rank
    rng = numpy.random.default_rng(SEED)
    q, dout = (rng.standard_normal((B, H_kv, H // H_kv, S, hs)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, H_kv, 1, S, hs)).astype(dtype) for _ in range(2))
    work = [0] * Z

    def keep_all(src, rows, cols):                 # called once per computed block: count it, drop nothing
        work[(r - src) % Z] += (rows.stop - rows.start) * (cols.stop - cols.start)
        return numpy.ones((rows.stop - rows.start, cols.stop - cols.start), dtype=bool)
    mine = split.take
    topo.stats.reset()
    _, cache = ring_forward(mine(q, 3), mine(k, 3), mine(v, 3), split, keep_all)
    forward, counted = topo.stats.calls["cp/send"], list(work)
    ring_backward(mine(dout, 3), cache)           # (computes the same blocks again: work doubles)
    return forward, topo.stats.calls["cp/send"] - forward, topo.stats.bytes["cp/send"], counted


def _number(fb: Feedback, fn, name: str, args: tuple, every_rank: bool = False):
    value, ok = fb.attempt(f"{name}{args}", fn, *args)
    if ok and not isinstance(value, numbers.Real):
        fb.problem(f"{name}{args} returned {value!r}, not a number", every_rank=every_rank)
        return None
    return value


def _messages(fb: Feedback, student, Z: int, forward: int, backward: int) -> None:
    got, ok = fb.attempt(f"messages({Z})", student.messages, Z)
    if not ok:
        return
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, numbers.Real) for x in got)):
        fb.problem(f"messages({Z}) returned {got!r}, not two numbers (forward, backward)", every_rank=True)
        return
    if tuple(got) == (forward, backward):
        fb.facts.append(f"messages of one layer at Z = {Z}: {forward} forward, {backward} backward, per rank")
        return
    fb.problem(f"messages at Z = {Z}: you predicted {got[0]:g} forward and {got[1]:g} backward, the counters of "
               f"the group cp measured {forward} and {backward} sends per rank", every_rank=True)
    if Z == 1:
        fb.hint("at Z = 1 there is no ring: the one rank holds every key and sends nothing")
    elif got[0] == Z:
        fb.hint("the forward's last block is used where it arrives: nothing is passed on after step Z - 1")
    elif got[1] == Z - 1:
        fb.hint("the backward passes K and V around again (Z - 1 sends), and with them their gradients dK and dV, "
                "which must come home to the rank that owns them: how many hops is that?")
    else:
        fb.hint("read the loop _around in mpi_tp/parallel/ring_attention.py: what is sent at each step s")


def _bytes(fb: Feedback, student, args: tuple, where: str, nbytes: int, Z: int) -> None:
    B, H, H_kv, S, hs, _, r, itemsize = args
    got = _number(fb, student.sent_bytes, "sent_bytes", args)
    if got is None:
        return
    if abs(got - nbytes) < 0.5:
        fb.facts.append(f"rank {r} at {where}: {nbytes} bytes sent in one layer")
        return
    fb.problem(f"bytes sent at {where}: you predicted {got:g}, the counters measured {nbytes}: off by "
               f"{got - nbytes:+g}")
    per = 2 * B * H_kv * hs * itemsize          # bytes of K and V (or dK and dV) for one position held
    if Z == 1:
        fb.hint("at Z = 1 the ring sends nothing")
    elif abs(got - nbytes * H / H_kv) < 0.5:
        fb.hint("K and V have H_kv heads, not H: under grouped-query attention each serves H / H_kv query heads")
    elif abs(got - per * (3 * Z - 2) * S / Z) < 0.5 or abs(got - per * (3 * Z - 2) * (S // Z)) < 0.5:
        fb.hint(f"every message is the block held at that step, rank r - s's S_(r-s) positions, and 2Z = {2 * Z} "
                f"does not divide S = {S}: the chunks are split_sizes(S, 2Z) = {split_sizes(S, 2 * Z)}, rank r's "
                "are chunks r and 2Z - 1 - r")
    else:
        fb.hint("one message is K and V (or dK and dV) of the block held: 2 B H_kv S_(r-s) hs itemsize bytes; "
                "which blocks are sent forward, which backward, and which gradients go round the whole ring?")


def _scores(fb: Feedback, student, S: int, Z: int, r: int, counted: list[int]) -> None:
    got = [_number(fb, student.scores, "scores", (S, Z, r, s)) for s in range(Z)]
    if any(g is None for g in got):
        return
    if all(abs(g - c) < 0.5 for g, c in zip(got, counted)):
        fb.facts.append(f"rank {r} at S = {S}, Z = {Z}: scores per ring step {counted}")
        return
    fb.problem(f"scores at S = {S}, Z = {Z}, per ring step: you predicted [{', '.join(f'{g:g}' for g in got)}], "
               f"the ring computed {counted}")
    runs = (split_sizes(S, Z), [S // Z] * Z)      # a plain split into Z runs, uneven or rounded down
    plain = [[n[r] * n[(r - s) % Z] if (r - s) % Z <= r else 0 for s in range(Z)] for n in runs]
    if any(all(abs(g - p) < 0.5 for g, p in zip(got, work)) for work in plain):
        fb.hint("that is the plain split's work (rank r the r-th run of S / Z positions): this ring holds two "
                "chunks, r and 2Z - 1 - r, one from each end of the sequence (mpi_tp/parallel/context_parallel.py)")
    else:
        fb.hint("a (query chunk, key chunk) block is computed when the key chunk is not after the query chunk, "
                "whole (a diagonal block too: the kernel masks it, after computing it); the chunks of S = {S} are "
                f"split_sizes(S, 2Z) = {split_sizes(S, 2 * Z)}")


def ring_bytes(student, comm, path=None) -> bool:
    """Exercise 6: messages, sent_bytes and scores of the student's file against a real ring's."""
    Z = comm.Get_size()
    needs_ranks(6, Z, low=1)
    if Z > MAX_Z:
        raise UserError(f"exercise 6 cuts S = {2 * MAX_Z + 1} positions into 2Z chunks: use at most {MAX_Z} ranks")
    topo = Topology.create(comm, tp=1, cp=Z)
    r = topo.cp.rank
    fb = Feedback(r, path)
    for i, (B, H, H_kv, S, hs, dtype) in enumerate(SHAPES):
        itemsize = numpy.dtype(dtype).itemsize
        forward, backward, nbytes, counted = measure(topo, B, H, H_kv, S, hs, dtype)
        if i == 0:                                # the same on every rank: one line in the report
            _messages(fb, student, Z, forward, backward)
        where = f"B = {B}, H = {H}, H_kv = {H_kv}, S = {S}, hs = {hs}, Z = {Z}, itemsize {itemsize}"
        _bytes(fb, student, (B, H, H_kv, S, hs, Z, r, itemsize), where, nbytes, Z)
        _scores(fb, student, S, Z, r, counted)
    topo.free()
    return finish(comm, 6, "one layer of ring attention", fb, [
        ("the lesson: mpiexec -n 2 mpi-tp explain --layer cp (the causal grid, the scores per step and each "
         "rank's bytes; try first), the docstrings of mpi_tp/parallel/context_parallel.py and ring_attention.py")],
        against="against the counters and the blocks of a real ring", size="Z")
