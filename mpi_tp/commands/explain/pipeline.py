"""`mpi-tp explain --layer pipeline`: a live lesson in pipeline schedules, drawn from the run's own clock.

    mpiexec -n 2 mpi-tp explain --layer pipeline               # P = 2 stages, M = 2P micro-batches
    mpiexec -n 4 mpi-tp explain --layer pipeline --micro-batches 8

Every rank is one stage of a tiny GPT (float64, one block per stage chunk).
For each schedule (GPipe, 1F1B, and the interleaved one with 2 chunks per
stage), one training step runs twice: once to warm up, once traced. Rank 0
then draws each stage's timeline from the traced timestamps (digits: the
forward of that micro-batch, letters: its backward, dots: waiting), next to
the schedule's ideal timeline (schedules.draw), and sets the measured bubble
beside the formula, (P - 1) / M or (P - 1) / (v M), and each stage's sends and
receives of the step (calls, buffer bytes, wire bytes: a send's wire bytes are
its buffer). The loss is checked against the serial model on the same batch.
"""
from __future__ import annotations

import numpy
from mpi4py import MPI

from mpi_tp.commands.explain.common import comm_text
from mpi_tp.core.runtime import rank0_print
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.model.chunks import build_stage
from mpi_tp.parallel.pipeline.schedules import draw, schedule
from mpi_tp.parallel.topology import Topology
from mpi_tp.parallel.trace import Trace

WIDTH = 64          # columns of a drawn timeline
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _timeline(events: list[list[dict]]) -> tuple[list[str], float]:
    """Each stage's F/B events as a row of WIDTH columns, and the measured bubble: the step's span
    over the busiest stage's working time, minus one."""
    start = min(e["ts"] for ev in events for e in ev)
    end = max(e["ts"] + e["dur"] for ev in events for e in ev)
    scale = WIDTH / (end - start)
    rows = []
    for ev in events:
        row = ["."] * WIDTH
        for e in ev:
            mark = str(e["args"]["micro"] % 10) if e["name"] == "F" else LETTERS[e["args"]["micro"] % 26]
            a, b = int((e["ts"] - start) * scale), max(int((e["ts"] + e["dur"] - start) * scale), 1 + int(
                (e["ts"] - start) * scale))
            for t in range(a, min(b, WIDTH)):
                row[t] = mark
        rows.append("".join(row))
    busy = max(sum(e["dur"] for e in ev) for ev in events)
    return rows, (end - start - busy) / busy


def lesson(comm, micro_batches: int | None = None) -> bool:
    """Run and draw each schedule on P = world size stages; True when every loss equals the serial one."""
    P = comm.Get_size()
    M = micro_batches or 2 * P
    x = numpy.random.default_rng(1).integers(0, 37, (M, 8))
    y = numpy.roll(x, -1, axis=1)
    rank0_print(f"pipeline of P = {P} stage(s) (one rank each), M = {M} micro-batches of 1 sequence, float64; "
                "digits: forward of a micro-batch, letters: its backward, dots: the stage waits", comm=comm)
    every = True
    for name, V in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        if name == "interleaved" and M % P:
            rank0_print(f"\n== interleaved == skipped: M = {M} is not a multiple of P = {P}", comm=comm)
            continue
        cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=P * V, n_head=2, n_embd=32)
        topo = Topology.create(comm, tp=1, pp=P, dp=1)
        stage = build_stage(cfg, topo, "float64", 0, False, name, M, V)
        stage.forward_backward(x, y, slice(0, M))                         # warm-up: caches, buffers
        topo.stats.reset()
        topo.stats.trace = trace = Trace(comm)
        loss = stage.forward_backward(x, y, slice(0, M))
        topo.stats.trace = None
        mine = [e for e in trace.events if e["name"] in ("F", "B")]
        everyone = comm.gather(mine, root=0)                              # a lesson: pickled once
        G = {"pp": P, "emb": 2}                                           # emb: the first and the last stage
        counted = comm.gather("; ".join(comm_text(k, v, G.get(k.split("/")[0], P))
                                        for k, v in topo.stats.snapshot().items()) or "none", root=0)
        reference = GPT(cfg, Topology.serial(), dtype="float64", seed=0)
        want = sum(reference.forward(x[m:m + 1], y[m:m + 1]) for m in range(M)) / M
        ok = bool(comm.allreduce(int(abs(loss - want) <= 1e-10 * abs(want)), op=MPI.MIN))
        every &= ok
        if comm.Get_rank() == 0:
            rows, bubble = _timeline(everyone)
            ideal = draw(schedule(name, P, M, V), 1, 2).splitlines()
            formula = (P - 1) / (V * M)
            print(f"\n== {name}" + (f", {V} chunks per stage" if V > 1 else "") + " ==")
            print("measured (this run's clock, scaled to the step):")
            print("\n".join(f"  stage {s}: {r}" for s, r in enumerate(rows)))
            print("ideal (forward 1, backward 2 time units, no communication):")
            print("\n".join(f"  {line}" for line in ideal))
            print("collectives of the step (n: the buffer bytes):")
            print("\n".join(f"  of stage {s}: {text}" for s, text in enumerate(counted)))
            print(f"bubble: measured {bubble:.3f} of the busiest stage's time, formula (P - 1) / "
                  f"{'(v M)' if V > 1 else 'M'} = {formula:.3f}; loss {loss:.10f} vs serial {want:.10f}: "
                  f"{'PASS' if ok else 'FAIL'}")
            print("  on a model this small the measured bubble is dominated by message latency and Python "
                  "overhead, not by the schedule: compare the formula with the ideal drawing above (a larger "
                  "model's measured bubble: docs/figures/pipeline_bubble.png)")
        topo.free()
    return every

