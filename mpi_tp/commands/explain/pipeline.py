"""`mpi-tp explain --layer pipeline`: a live lesson in pipeline schedules, drawn from the run's own clock.

    mpiexec -n 2 mpi-tp explain --layer pipeline               # P = 2 stages, M = 2P micro-batches
    mpiexec -n 4 mpi-tp explain --layer pipeline --micro-batches 8

Every rank is one stage of the same tiny GPT (float64, L = 2P blocks) under
each schedule: GPipe, 1F1B and ZB-H1 run a stage's two blocks as one chunk,
the interleaved one as v = 2 chunks of one block (stage s holds blocks s and
P + s), ZB-V as two chunks placed in a V (blocks s and 2P - 1 - s), so all
give the same loss. For each schedule one training step runs twice: once to
warm up, once traced. Rank 0 then draws each stage's timeline from the traced
timestamps (digits: the forward of that micro-batch, letters: its backward,
or its B where the backward is cut, capitals: its W, dots: waiting), next to
the schedule's ideal timeline (schedules.draw, in time units of one block),
and sets the bubble (idle time over compute time, of the busiest stage:
docs/notation.md) measured in the step beside the ideal drawing's and the
formula (ideal_formula), with each stage's sends and receives of the step (calls,
buffer bytes, wire bytes: a send's wire bytes are its buffer). The loss is
checked against the serial model on the same batch.
"""
from __future__ import annotations

import numpy
from mpi4py import MPI

from mpi_tp.commands.explain.common import comm_text
from mpi_tp.core.runtime import rank0_print
from mpi_tp.model.chunks import build_stage
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.pipeline.schedules import V_SHAPED, draw, schedule, simulate
from mpi_tp.parallel.topology import Topology
from mpi_tp.parallel.trace import Trace
from mpi_tp.training.step import forward_backward

WIDTH = 64          # columns of a drawn timeline
LETTERS = "abcdefghijklmnopqrstuvwxyz"
BLOCKS = 2          # blocks per stage: one chunk of 2 (GPipe, 1F1B) or 2 chunks of 1 (interleaved)
T_F, T_B = 1, 2     # the ideal drawing's time units: one block's forward, its backward
BUBBLE = "bubble = idle time / compute time, of the busiest stage (docs/notation.md)"
BELOW = ("the measured bubble counts as idle whatever happens between a stage's forwards and backwards: on a "
         "model this small, mostly message latency and Python overhead, so it lies above the formula. On a larger "
         "model it can also fall below it: the formula assumes that every stage takes as long as the busiest one "
         "for each forward and backward, and stages that are not equally heavy (the first also holds the "
         "embedding, the last the output layer and the loss) leave the busiest one waiting on lighter ones, for "
         "less than P - 1 of its own forwards and backwards (a larger model's measured bubble: "
         "docs/figures/pipeline_bubble.png)")


def _timeline(events: list[list[dict]]) -> tuple[list[str], float]:
    """Each stage's F/B/W events as a row of WIDTH columns, and the measured bubble: the step's span
    minus the busiest stage's compute time (its F, B and W events), over that compute time. A stage runs one
    action at a time, so its events are drawn in order, each in columns of its own: one shorter than a column
    (a W under load) still shows, nudged right past the one before it (while a stage has no more events than
    columns)."""
    start = min(e["ts"] for ev in events for e in ev)
    end = max(e["ts"] + e["dur"] for ev in events for e in ev)
    scale = WIDTH / (end - start)
    rows = []
    for ev in events:
        row, free, ev = ["."] * WIDTH, 0, sorted(ev, key=lambda e: e["ts"])
        for i, e in enumerate(ev):
            letter = LETTERS[e["args"]["micro"] % 26]
            mark = {"F": str(e["args"]["micro"] % 10), "B": letter, "W": letter.upper()}[e["name"]]
            last = WIDTH - (len(ev) - i if len(ev) <= WIDTH else 1)     # a column left for each event after
            a = min(max(int((e["ts"] - start) * scale), free), last)
            b = min(max(int((e["ts"] + e["dur"] - start) * scale), a + 1), last + 1)
            row[a:b] = mark * (b - a)
            free = b
        rows.append("".join(row))
    busy = max(sum(e["dur"] for e in ev) for ev in events)
    return rows, (end - start - busy) / busy


FORMULA = {"gpipe": "(P - 1) / M", "1f1b": "(P - 1) / M", "interleaved": "(P - 1) / (v M)",
           "zb-h1": "(P - 1) / (3M)", "zb-v": "(P - 1) / (6M)"}       # at T_F = T_B / 2 = T_W (the drawing's times)


def ideal_formula(name: str, P: int, M: int, v: int) -> float:
    """The bubble of schedule `name` at the ideal drawing's times, a block's F 1 unit, its backward 2 (B 1 and
    W 1 where cut): (P - 1) / M for GPipe and 1F1B, / (v M) interleaved, / (3M) ZB-H1 (Qi et al.'s
    (P - 1)(T_F + T_B - T_W)), and for ZB-V the last rank's start alone, P - 1 chunk forwards over the
    stage's 6M chunk units (Qi et al. count it as none: they start the next step early, mpi_tp does not)."""
    return (P - 1) / {"interleaved": v * M, "zb-h1": 3 * M, "zb-v": 6 * M}.get(name, M)


def _ideal(name: str, P: int, M: int, v: int) -> tuple[str, str]:
    """The ideal drawing in block time units, and its bubble counted from it: 'idle / compute = value'."""
    plan = schedule(name, P, M, v)
    per = BLOCKS // v                                                  # blocks per chunk
    sim = simulate(plan, T_F * per, T_B * per, v_shape=name in V_SHAPED)
    busy = max(sim["busy"])
    idle = sim["time"] - busy
    return draw(plan, T_F * per, T_B * per, name in V_SHAPED), f"{idle:g} / {busy:g} = {idle / busy:.3f}"


def lesson(comm, micro_batches: int | None = None) -> bool:
    """Run and draw each schedule on P = world size stages; True when every loss equals the serial one."""
    P = comm.Get_size()
    M = micro_batches or 2 * P
    x = numpy.random.default_rng(1).integers(0, 37, (M, 8))
    y = numpy.roll(x, -1, axis=1)
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=BLOCKS * P, n_head=2, n_embd=32)
    reference = GPT(cfg, Topology.serial(), dtype="float64", seed=0)
    want = sum(reference.forward(x[m:m + 1], y[m:m + 1]) for m in range(M)) / M
    rank0_print(f"pipeline of P = {P} stage(s) (one rank each), M = {M} micro-batches of 1 sequence, float64\n"
                f"the same model under every schedule, so the same loss: L = {BLOCKS * P} blocks, {BLOCKS} per stage, "
                f"run as one chunk by GPipe and 1F1B, as v = {BLOCKS} chunks of one block by the interleaved "
                f"schedule (stage s holds blocks s and P + s)\ndigits: forward of a micro-batch, letters: its "
                f"backward, dots: the stage waits\n{BUBBLE}", comm=comm)
    every = True
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", BLOCKS), ("zb-h1", 1), ("zb-v", BLOCKS)):
        if name == "interleaved" and M % P:
            rank0_print(f"\n== interleaved == skipped: M = {M} is not a multiple of P = {P}", comm=comm)
            continue
        topo = Topology.create(comm, tp=1, pp=P, dp=1)
        stage = build_stage(cfg, topo, "float64", 0, False, name, M, v)
        forward_backward(stage, x, y, slice(0, M))                         # warm-up: caches, buffers
        topo.stats.reset()
        topo.stats.trace = trace = Trace(comm)
        loss = forward_backward(stage, x, y, slice(0, M))
        topo.stats.trace = None
        mine = [e for e in trace.events if e["name"] in ("F", "B", "W")]
        everyone = comm.gather(mine, root=0)                              # a lesson: pickled once
        G = {"pp": P, "emb": 2}                                           # emb: the first and the last stage
        counted = comm.gather("; ".join(comm_text(k, val, G.get(k.split("/")[0], P))
                                        for k, val in topo.stats.snapshot().items()) or "none", root=0)
        ok = bool(comm.allreduce(int(abs(loss - want) <= 1e-10 * abs(want)), op=MPI.MIN))
        every &= ok
        if comm.Get_rank() == 0:
            rows, bubble = _timeline(everyone)
            ideal, counted_ideal = _ideal(name, P, M, v)
            formula = ideal_formula(name, P, M, v)
            print(f"\n== {name}" + (f", {v} chunks per stage" if v > 1 else "") + " ==")
            print("measured (this run's clock, scaled to the step):")
            print("\n".join(f"  stage {s}: {r}" for s, r in enumerate(rows)))
            print(f"ideal (a block's forward {T_F} time unit, its backward {T_B}; no communication):")
            print("\n".join(f"  {line}" for line in ideal.splitlines()))
            print("collectives of the step (n: the buffer bytes):")
            print("\n".join(f"  of stage {s}: {text}" for s, text in enumerate(counted)))
            print(f"bubble (idle / compute, busiest stage): measured {bubble:.3f}, ideal drawing {counted_ideal}, "
                  f"formula {FORMULA[name]} = {formula:.3f}; loss {loss:.10f} vs serial "
                  f"{want:.10f}: {'PASS' if ok else 'FAIL'}")
        topo.free()
    rank0_print(f"\n{BELOW}", comm=comm)
    return every
