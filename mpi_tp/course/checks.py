"""The checks of exercises 1-3: a student's layer at T = world size against the serial layer.

Each builds the student's layer on the job's tensor-parallel group and the real
layer on one rank (Topology.serial), both from the same seed and names, runs a
forward and a backward pass on the same random X and dY (float64), and compares
the output, the input gradient, every parameter gradient and the collectives of
each pass. Exercise 1 also checks what enters g: the lesson's row layer hands
the all-reduce its partial sum X_i A_i alone and adds b once, after it, so a
bias shared out over the partials (b / T on every rank, or b on one rank)
fails even though the sum comes out right. What is wrong is explained when the
check can tell why.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy

from mpi_tp.core.testing import all_true
from mpi_tp.course.common import (
    F64,
    RTOL,
    SEED,
    B,
    C,
    Feedback,
    S,
    build,
    describe,
    finish,
    needs_ranks,
)
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.mlp import ParallelMLP
from mpi_tp.model.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mpi_tp.parallel.topology import Topology

K = 2 * C + 1             # the row layer's input, the column layer's output: odd, so shards differ by one
UNIT = B * S * C * 8      # one (B, S, C) float64 activation: the bytes of one f or g


def _cut(a, cols):
    return a if cols is None else numpy.ascontiguousarray(a[..., cols])


def run_layer(fb: Feedback, comm, topo, par, ser, n_in, n_out, in_cols, out_cols, expect: dict):
    """Forward and backward of the student's `par` and the serial `ser`; records every difference in fb.
    in_cols/out_cols: this rank's columns of X / Y (None: whole). expect: {"forward": {...}, "backward": ...}.
    Returns what the diagnoses need, or None when the student's code raised on some rank."""
    rng = numpy.random.default_rng(SEED)
    x, dout = rng.standard_normal((B, S, n_in)), rng.standard_normal((B, S, n_out))
    y_ref = ser.forward(x)
    dx_ref = ser.backward(dout)
    got = {"x_i": _cut(x, in_cols), "dout_i": _cut(dout, out_cols), "y_ref": _cut(y_ref, out_cols),
           "entered": {}}
    counters = {}
    for phase, fn, arg in (("forward", par.forward, got["x_i"]), ("backward", par.backward, got["dout_i"])):
        topo.stats.reset()
        with _recording(topo.tp) as got["entered"][phase]:
            got[phase], ok = fb.attempt(phase, fn, arg.copy())
        if not all_true(ok, comm):
            return None
        counters[phase] = topo.stats.snapshot()
    right = []
    err_y = fb.compare("output Y" + ("_i (this rank's columns)" if out_cols else ""), got["forward"],
                       _cut(y_ref, out_cols))
    err_dx = fb.compare("input gradient dX" + ("_i (this rank's columns)" if in_cols else ""), got["backward"],
                        _cut(dx_ref, in_cols))
    right += ["output Y"] * (err_y <= RTOL) + ["input gradient dX"] * (err_dx <= RTOL)
    reference = {q.name: q for q in ser.parameters()}
    scale = max(float(numpy.abs(q.grad).max()) for q in ser.parameters())
    for q in par.parameters():
        if q.name not in reference:
            fb.problem(f"parameter {q.name} is not one of the serial layer's ({', '.join(reference)}): "
                       "keep the names of the shipped file")
            continue
        ref = reference[q.name]
        if q.global_shape != ref.global_shape:
            fb.problem(f"parameter {q.name} is {q.global_shape} in all, the serial layer's {ref.global_shape}")
            continue
        if fb.compare(f"gradient of {q.name}", q.grad, ref.grad[q.index()], scale) <= RTOL:
            right.append(f"gradient of {q.name}")
    for phase in ("forward", "backward"):
        fb.counters(phase, counters[phase], expect[phase], UNIT)
    if fb.problems and right:
        fb.note(f"rank {fb.rank} gets these right: {', '.join(right)}")
    if not fb.problems:
        fb.facts.append("on every rank, the output, dX and every parameter gradient equal the serial layer")
    return got


@contextmanager
def _recording(group):
    """A list that receives a copy of every array handed to group.all_reduce while the block runs (the
    group's own method is wrapped on this instance only, and restored after)."""
    seen, real = [], group.all_reduce

    def all_reduce(x, *args, **kwargs):
        seen.append(numpy.array(x, copy=True))
        return real(x, *args, **kwargs)
    group.all_reduce = all_reduce
    try:
        yield seen
    finally:
        del group.all_reduce                                  # the class's method again


def _expected_facts(fb, expect):
    fb.facts.append(f"collectives: forward {describe(expect['forward'], UNIT)}; "
                    f"backward {describe(expect['backward'], UNIT)}")


def _close(a, b) -> bool:
    return a.shape == b.shape and bool(numpy.abs(a - b).max() <= RTOL * max(1.0, float(numpy.abs(b).max())))


def _why_row(fb, got, par, T) -> None:
    """Recognize the bias added T times, or partials never summed."""
    try:
        y, b = got["forward"], par.bias.data if par.bias is not None else None
        diff, partial = y - got["y_ref"], got["x_i"] @ par.weight.data
        if b is not None and float(b @ b) > 0:
            k = float(numpy.sum(diff * b) / (b @ b) / (B * S))
            if abs(k) > 0.5 and _close(diff, k * numpy.broadcast_to(b, diff.shape)):
                fb.note(f"on rank {fb.rank}, Y - Y_serial = {k:.2f} b: the bias is added {k + 1:.0f} times "
                        f"instead of once (T = {T})")
        if _close(y, partial) or (b is not None and _close(y, partial + b)):
            fb.note(f"on rank {fb.rank}, Y is this rank's own partial sum X_i A_i: g never summed the partials")
    except Exception:  # noqa: BLE001, S110 -- a diagnosis only: the student's layer may hold anything
        pass


def _g_input_row(fb, got, par, T) -> None:
    """What entered g in the forward must be this rank's partial sum X_i A_i alone: any part of b added
    before the reduce (b / T on every rank sums back to b) sends the replicated bias through g."""
    entered = got["entered"]["forward"]
    if len(entered) != 1:                                     # the counters report the wrong number of calls
        return
    try:
        partial = got["x_i"] @ par.weight.data
        if entered[0].shape != partial.shape or _close(entered[0], partial):
            return
        diff, b = entered[0] - partial, par.bias.data
        k = float(numpy.sum(diff * b) / (b @ b) / (B * S)) if float(b @ b) > 0 else 0.0
    except Exception:  # noqa: BLE001 -- the student's layer may hold anything
        return
    fb.problem("what enters g (the forward all-reduce) is not this rank's partial sum X_i A_i"
               + (f": it is X_i A_i + {k:.2f} b" if k and _close(diff, k * numpy.broadcast_to(b, diff.shape))
                  else ""))
    if _close(got["forward"], got["y_ref"]):
        fb.note(f"the output is right (g adds the T = {T} shares of b back to one b), but b went through the "
                "all-reduce: it is replicated, every rank holds all of it, so the lesson's layer hands g the "
                "partial sums alone and adds b once, after the reduce")


def row_bias(student, comm, path=None) -> bool:
    """Exercise 1: RowLinear (a RowParallelLinear) at T = world size against the serial row layer."""
    T = comm.Get_size()
    needs_ranks(1, T)
    topo, serial = Topology.create(comm), Topology.serial()
    fb = Feedback(topo.tp.rank, path)
    par, ok = fb.attempt("RowLinear(...)", build, lambda: student.RowLinear("row", K, C, topo.tp, F64, seed=SEED))
    ser = build(lambda: RowParallelLinear("row", K, C, serial.tp, F64, seed=SEED))
    expect = {"forward": {"tp/all_reduce": (1, UNIT)}, "backward": {}}
    if all_true(ok, comm):
        got = run_layer(fb, comm, topo, par, ser, K, C, slice(par.weight.start, par.weight.stop), None, expect)
        if got is not None:
            _g_input_row(fb, got, par, T)
        if got is not None and fb.problems:
            _why_row(fb, got, par, T)
        _expected_facts(fb, expect)
    topo.free()
    serial.free()
    return finish(comm, 1, "the row layer's bias", fb, [
        ("b is replicated: every rank holds all of it. g adds up whatever each rank holds; "
         "where must b go so that it is counted once?"),
        "the lesson: mpiexec -n 2 mpi-tp explain --layer row; docs/learn.md, 'The row split'"])


def mlp_order(student, comm, path=None) -> bool:
    """Exercise 2: MLP at T = world size against the serial ParallelMLP (fc column, proj row)."""
    T = comm.Get_size()
    needs_ranks(2, T)
    topo, serial = Topology.create(comm), Topology.serial()
    cfg = GPTConfig(vocab_size=1, block_size=S, n_layer=1, n_head=1, n_embd=C)      # the MLP reads C only
    fb = Feedback(topo.tp.rank, path)
    par, ok = fb.attempt("MLP(...)", build, lambda: student.MLP("mlp", cfg, topo, F64, SEED))
    ser = build(lambda: ParallelMLP("mlp", cfg, serial, F64, SEED))
    expect = {"forward": {"tp/all_reduce": (1, UNIT)}, "backward": {"tp/all_reduce": (1, UNIT)}}
    if all_true(ok, comm):
        got = run_layer(fb, comm, topo, par, ser, C, C, None, None, expect)
        if got is None:
            fb.note("the MLP's input X (B, S, C) is whole on every rank: a row-split layer expects its input "
                    "split by columns, X_i (B, S, C_i); a column-split layer takes X whole")
        elif any("collectives" in p for p in fb.problems):
            fb.note(f"Megatron's order communicates once each way: g after the second layer, f's backward "
                    f"before the first, each B S C itemsize = {UNIT} buffer bytes")
        _expected_facts(fb, expect)
    topo.free()
    serial.free()
    return finish(comm, 2, "the order of the MLP's splits", fb, [
        ("which split leaves its output split by columns, and which one takes its input split that way? "
         "Pass sizes=self.fc.sizes to the second layer so that its shards match the first one's"),
        "the lesson: mpiexec -n 2 mpi-tp explain --layer mlp; docs/learn.md, section 3 (the block)"])


def f_backward(student, comm, path=None) -> bool:
    """Exercise 3: ColumnLinear (a ColumnParallelLinear) at T = world size against the serial column layer."""
    T = comm.Get_size()
    needs_ranks(3, T)
    topo, serial = Topology.create(comm), Topology.serial()
    fb = Feedback(topo.tp.rank, path)
    par, ok = fb.attempt("ColumnLinear(...)", build,
                         lambda: student.ColumnLinear("column", C, K, topo.tp, F64, seed=SEED))
    ser = build(lambda: ColumnParallelLinear("column", C, K, serial.tp, F64, seed=SEED))
    expect = {"forward": {}, "backward": {"tp/all_reduce": (1, UNIT)}}
    if all_true(ok, comm):
        cols = slice(par.weight.start, par.weight.stop)
        got = run_layer(fb, comm, topo, par, ser, C, K, None, cols, expect)
        if got is not None and any("dX" in p for p in fb.problems):
            part = got["dout_i"] @ par.weight.data.T
            if part.shape == got["backward"].shape and _close(got["backward"], part):
                others = f"the parts of the other {T - 1} ranks were" if T > 2 else "the other rank's part was"
                fb.note(f"on rank {fb.rank}, dX is only this rank's part dY_i A_i^T: {others} never added")
        _expected_facts(fb, expect)
    topo.free()
    serial.free()
    return finish(comm, 3, "f's backward in the column layer", fb, [
        ("X reached every rank's columns through f. What is f's backward, and does this backward call it? "
         "(mpi_tp.parallel.tensor_parallel)"),
        ("the lesson: mpiexec -n 2 mpi-tp explain --layer column; docs/learn.md, "
         "'The two together: f, g and their mirror images'")])
