"""The check of exercise 5: the student's formulas for the bytes of one step, against the counters.

One forward and one backward pass of a GPT block at T = world size, measured at
two shapes (float64 and float32, so that itemsize matters): the sums of the
buffer bytes and of the wire bytes of every tensor-parallel collective in
CommStats, against buffer_bytes(B, S, C, T, itemsize) and wire_bytes(...).
"""
from __future__ import annotations

import numbers

import numpy

from mpi_tp.course.common import SEED, Feedback, finish, needs_ranks
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.dropout import Dropout
from mpi_tp.model.gpt import Block
from mpi_tp.parallel.topology import Topology

SHAPES = ((2, 4, 8, numpy.float64), (3, 5, 12, numpy.float32))     # (B, S, C, dtype)


def measure(topo: Topology, B: int, S: int, C: int, dtype) -> tuple[int, float, int]:
    """(buffer bytes, wire bytes, calls) of the tp collectives of one block's forward + backward."""
    T = topo.tp.size
    H = min(h for h in range(max(2, T), C + 1) if C % h == 0)      # every rank needs a head
    cfg = GPTConfig(vocab_size=1, block_size=S, n_layer=1, n_head=H, n_embd=C)
    block = Block(0, cfg, topo, dtype, SEED, Dropout(0.0, SEED))
    rng = numpy.random.default_rng(SEED)
    x, dout = (rng.standard_normal((B, S, C)).astype(dtype) for _ in range(2))
    topo.stats.reset()
    block.forward(x)
    block.backward(dout)
    keys = [k for k in topo.stats.calls if k.startswith("tp/")]
    return (sum(topo.stats.bytes[k] for k in keys), sum(topo.stats.wire[k] for k in keys),
            sum(topo.stats.calls[k] for k in keys))


def _predict(fb: Feedback, fn, name: str, args: tuple):
    value, ok = fb.attempt(f"{name}{args}", fn, *args)
    if ok and not isinstance(value, numbers.Real):
        fb.problems.append(f"{name}{args} returned {value!r}, not a number")
        return None
    return value


def step_bytes(student, comm, path=None) -> bool:
    """Exercise 5: buffer_bytes and wire_bytes of the student's file against a real block's counters."""
    T = comm.Get_size()
    needs_ranks(5, T, low=1)
    topo = Topology.create(comm)
    fb = Feedback(topo.tp.rank, path)
    for B, S, C, dtype in SHAPES:
        itemsize = numpy.dtype(dtype).itemsize
        n, wire, calls = measure(topo, B, S, C, dtype)
        if fb.rank != 0:            # every rank measures the same: rank 0 speaks
            continue
        args = (B, S, C, T, itemsize)
        where = f"B = {B}, S = {S}, C = {C}, T = {T}, itemsize {itemsize}"
        guess_n = _predict(fb, student.buffer_bytes, "buffer_bytes", args)
        guess_w = _predict(fb, student.wire_bytes, "wire_bytes", args)
        unit = B * S * C * itemsize
        if guess_n is not None and abs(guess_n - n) > 0.5:
            fb.problems.append(f"buffer bytes at {where}: you predicted {guess_n:g}, the counters measured {n} "
                       f"({calls} all-reduces of B S C itemsize = {unit}): off by {guess_n - n:+g}")
            if T == 1:
                fb.hint("at T = 1 nothing is communicated: one-rank groups return before any MPI call, "
                        "and the counters stay empty")
            elif n and guess_n == n / 2:
                fb.hint("you counted one pass: each g of the forward has an f in the backward, "
                        "and f's backward all-reduces dX")
            else:
                fb.hint("a block has two g's forward (after attention, after the MLP) and two f's backward; "
                        "each all-reduce moves one (B, S, C) activation: B S C itemsize buffer bytes")
        if guess_w is not None and abs(guess_w - wire) > 1e-6 * max(1.0, wire):
            fb.problems.append(f"wire bytes at {where}: you predicted {guess_w:g}, the counters measured {wire:g}: "
                       f"off by {guess_w - wire:+g}")
            fb.hint("a ring all-reduce of n buffer bytes is a reduce-scatter then an all-gather, "
                    "each sending (T-1)/T n: 2 (T-1)/T n wire bytes per rank (docs/notation.md, 'Bytes')")
        fb.facts.append(f"at {where}: {n} buffer bytes and {wire:g} wire bytes ({calls} all-reduces)")
    topo.free()
    return finish(comm, 5, "the bytes of one step of a block", fb, [
        ("the lesson: mpiexec -n 2 mpi-tp explain --layer block prints each pass's collectives and bytes; "
         "docs/learn.md, section 7 (counting the communication)")], against="against the counters of a real block")
