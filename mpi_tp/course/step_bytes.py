"""The check of exercise 5: the student's formulas for the bytes of one training step, against the counters.

One training step of a small GPT at T = world size (plain tensor parallelism):
forward with the loss, backward, and the gradient norm, measured at two shapes
(float64 and float32, different L and V): the sums of the buffer bytes and of
the wire bytes of every tensor-parallel collective in CommStats, against
buffer_bytes(B, S, C, V, L, T, itemsize) and wire_bytes(...).
"""
from __future__ import annotations

import numpy

from mpi_tp.course.common import SEED, Feedback, finish, needs_ranks
from mpi_tp.model.config import GPTConfig, fewest_heads
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.finalize import finalize_grads
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import grad_norm

SHAPES = ((2, 4, 8, 37, 2, numpy.float64), (3, 5, 12, 50, 1, numpy.float32))     # (B, S, C, V, L, dtype)


def measure(topo: Topology, B: int, S: int, C: int, V: int, L: int, dtype) -> tuple[int, float, int]:
    """(buffer bytes, wire bytes, calls) of the tp collectives of one training step."""
    T = topo.tp.size
    H = fewest_heads(C, T)                                         # every rank needs a head
    model = GPT(GPTConfig(vocab_size=V, block_size=S, n_layer=L, n_head=H, n_embd=C), topo, dtype=dtype, seed=SEED)
    rng = numpy.random.default_rng(SEED)
    x, y = (rng.integers(0, V, (B, S)) for _ in range(2))
    topo.stats.reset()
    model.forward(x, y)
    model.backward()
    finalize_grads(model)                                          # (plain TP: nothing to complete)
    grad_norm(model.parameters(), topo.tp)
    keys = [k for k in topo.stats.calls if k.startswith("tp/")]
    return (sum(topo.stats.bytes[k] for k in keys), sum(topo.stats.wire[k] for k in keys),
            sum(topo.stats.calls[k] for k in keys))


def step_bytes(student, comm, path=None) -> bool:
    """Exercise 5: buffer_bytes and wire_bytes of the student's file against a real step's counters."""
    T = comm.Get_size()
    needs_ranks(5, T, low=1)
    topo = Topology.create(comm)
    fb = Feedback(topo.tp.rank, path)
    for B, S, C, V, L, dtype in SHAPES:
        itemsize = numpy.dtype(dtype).itemsize
        n, wire, calls = measure(topo, B, S, C, V, L, dtype)
        if fb.rank != 0:            # every rank measures the same: rank 0 speaks
            continue
        args = (B, S, C, V, L, T, itemsize)
        where = f"B = {B}, S = {S}, C = {C}, V = {V}, L = {L}, T = {T}, itemsize {itemsize}"
        guess_n = fb.predict(student.buffer_bytes, "buffer_bytes", args)
        guess_w = fb.predict(student.wire_bytes, "wire_bytes", args)
        act = B * S * C * itemsize
        if guess_n is not None and abs(guess_n - n) > 0.5:
            fb.problems.append(f"buffer bytes at {where}: you predicted {guess_n:g}, the counters measured {n} "
                               f"in {calls} all-reduces: off by {guess_n - n:+g}")
            if T == 1:
                fb.hint("at T = 1 nothing is communicated: one-rank groups return before any MPI call, "
                        "and the counters stay empty")
            elif abs(guess_n - (n - 8 - 3 * B * S * itemsize) / 2) < 0.5 or abs(guess_n - 2 * L * act) < 0.5:
                fb.hint("you counted one pass: each g of the forward has an f in the backward, "
                        "and f's backward all-reduces dX")
            elif abs(guess_n - (n - 8 - 3 * B * S * itemsize)) < 0.5:
                fb.hint("the activations are right; now the loss (the row maxima, then two sums per position, "
                        "one all-reduce each) and the gradient norm (one float64)")
            else:
                fb.hint("list the step's collectives in order: the embedding's g, each block's two g's, the loss, "
                        "then backward each block's two f's and the tied output layer's f, then the norm; "
                        f"one (B, S, C) activation is B S C itemsize = {act} bytes here")
        if guess_w is not None and abs(guess_w - wire) > 1e-6 * max(1.0, wire):
            fb.problems.append(f"wire bytes at {where}: you predicted {guess_w:g}, the counters measured {wire:g}: "
                               f"off by {guess_w - wire:+g}")
            fb.hint("every collective of this step is an all-reduce, and a ring all-reduce of n buffer bytes is a "
                    "reduce-scatter then an all-gather, each sending (T-1)/T n: 2 (T-1)/T n wire bytes per rank "
                    "(docs/notation.md, 'Bytes')")
        fb.facts.append(f"at {where}: {n} buffer bytes and {wire:g} wire bytes ({calls} all-reduces)")
    topo.free()
    return finish(comm, 5, "the bytes of one training step", fb, [
        ("the lessons: mpiexec -n 2 mpi-tp explain --layer block, --layer embedding, --layer loss (what each part "
         "sends); once you have tried, the answer: mpi-tp explain --layer step (each phase's collectives and "
         "bytes), docs/learn.md section 7")],
        against="against the counters of a real step")
