"""`mpi-tp calibrate`: measure this machine's constants for the cost model.

    mpiexec -n 2 mpi-tp calibrate --out machine.json     # then: mpi-tp plan --machine machine.json ...

- GEMM rate: the matrix products of a transformer layer (q/k/v, projection, MLP;
  forward, dX and dW) at the calibration shapes, timed on every rank at once (ranks
  share the machine as they will in a run); and the same products with 32 to 4096
  rows (the B S tokens of a micro-batch): the GEMM curve, so that the planner
  prices small micro-batches at the rate they really get.
- Per-layer overhead: training steps of a tiny model (hidden 32, 8 positions) with
  1 and 5 blocks: a quarter of the difference is what a layer costs regardless of
  its size (the interpreter, launches).
- Elementwise rate: timed training steps of the calibration shapes at
  tensor-parallel size 1 on every rank at once; what the GEMMs, the per-layer
  overhead and the optimizer do not explain, divided by the model's count of
  elementwise work (a one-parameter least-squares fit).
- Overlap: a data-parallel-sized Iallreduce started before a block of GEMMs,
  tested between them (as the training loop does), against the two run apart:
  the fraction of the shorter one hidden (dp_overlap; 0 for a one-rank job).
- Memory bandwidth of the optimizer: a timed AdamW update of 8M parameters.
- Collectives: all-reduce of n = 1 KB..4 MB over the world (T ranks), fitted to
  the ring model t = 2(T-1) alpha + 2(T-1)/T n beta (beta = 1 / bandwidth; the
  same link is used for "intra" and "inter" unless the job spans nodes, where
  the fit is over the whole world); the timed points are kept in the file
  (allreduce_points) so that the fit can be redone by hand (docs/costmodel.md).
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy
from mpi4py import MPI

from mpi_tp.core.errors import UserError, refuse_to_replace
from mpi_tp.core.mpi_library import library_version
from mpi_tp.core.runtime import collective_setup, rank0_print
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.planning.costmodel import Plan, Workload, step_time
from mpi_tp.planning.machines import Machine
from mpi_tp.training.optim import AdamW
from mpi_tp.training.step import train_step

SHAPES = [(128, 2, 2, 64, 4), (256, 4, 2, 64, 4), (256, 4, 2, 128, 4), (384, 6, 2, 128, 4)]   # C, H, L, S, B
CURVE_ROWS = (32, 128, 512, 2048, 4096)


# Noise on a shared machine only ever slows a run down, so the calibration keeps the fastest
# of several repeats: the machine's speed when nothing else disturbs it.


def _fastest_step(model, opt, x, y, steps):
    ts = []
    for i in range(steps + 1):
        t = time.perf_counter()
        train_step(model, opt, x, y, slice(0, len(x)))          # the library's step (mpi_tp.training.step)
        if i:
            ts.append(time.perf_counter() - t)
    return min(ts)


def measure_steps(steps=5, shapes=SHAPES) -> list[tuple]:
    """[(Workload, seconds per step)] on this rank, tp = 1."""
    out = []
    for C, H, L, S, B in shapes:
        model = GPT(GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=S), Topology.serial(), dtype="float32")
        opt = AdamW(model.parameters())
        rng = numpy.random.default_rng(0)
        x, y = rng.integers(0, 256, (B, S)), rng.integers(0, 256, (B, S))
        out.append((Workload(L, C, H, S, B), _fastest_step(model, opt, x, y, steps)))
    return out


def _layer_gemms(rng, N, C):
    """The matrix products of one layer's forward, dX and dW with N rows: [(x, w, d)], FLOPs."""
    mats = []
    for K, M in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)):
        mats.append((rng.standard_normal((N, K), dtype=numpy.float32), rng.standard_normal((K, M), dtype=numpy.float32),
                     rng.standard_normal((N, M), dtype=numpy.float32)))
    return mats, sum(3 * 2 * N * x.shape[1] * w.shape[1] for x, w, _ in mats)


def _run(mats, between=None):
    for x, w, d in mats:
        x @ w, d @ w.T, x.T @ d                              # forward, dX, dW
        if between is not None:
            between()


def _timed(comm, work, repeats=7) -> float:
    """The fastest of `repeats` runs of work(), every rank at once."""
    work()
    ts = []
    for _ in range(repeats):
        comm.Barrier()
        t = time.perf_counter()
        work()
        ts.append(time.perf_counter() - t)
    return min(ts)


def gemm_rate(comm, repeats=7) -> float:
    """FLOP/s of a layer's matrix products at the calibration shapes, all ranks at once (fastest)."""
    rng = numpy.random.default_rng(0)
    flops, seconds = 0.0, 0.0
    for C, H, L, S, B in SHAPES:
        mats, f = _layer_gemms(rng, B * S, C)
        flops += f
        seconds += _timed(comm, lambda mats=mats: _run(mats), repeats)
    return comm.allreduce(flops / seconds, op=MPI.MIN)


def gemm_curve(comm, C=256, repeats=5) -> list:
    """[[rows, FLOP/s]]: a layer's matrix products (hidden C) with CURVE_ROWS rows, all ranks at once."""
    rng = numpy.random.default_rng(0)
    curve = []
    for rows in CURVE_ROWS:
        mats, f = _layer_gemms(rng, rows, C)
        curve.append([rows, comm.allreduce(f / _timed(comm, lambda mats=mats: _run(mats), repeats), op=MPI.MIN)])
    return curve


def overlap_fraction(comm, n_bytes=8 * 2**20, repeats=5) -> float:
    """How much of an Iallreduce of n_bytes a block of GEMMs hides when the request is tested
    between them: (apart - together) / the shorter of the two, in [0, 1]; 0 for one rank."""
    if comm.Get_size() == 1:
        return 0.0
    buf = numpy.ones(n_bytes // 4, dtype=numpy.float32)
    mats, _ = _layer_gemms(numpy.random.default_rng(0), 512, 256)

    def reduce():
        comm.Iallreduce(MPI.IN_PLACE, buf).Wait()

    def together():
        req = comm.Iallreduce(MPI.IN_PLACE, buf)
        _run(mats * 4, between=req.Test)
        req.Wait()
    comm_s, gemm_s = _timed(comm, reduce, repeats), _timed(comm, lambda: _run(mats * 4), repeats)
    both = _timed(comm, together, repeats)
    hidden = (comm_s + gemm_s - both) / min(comm_s, gemm_s)
    return comm.allreduce(float(min(1.0, max(0.0, hidden))), op=MPI.MIN)


def optimizer_bandwidth(n=8_000_000) -> float:
    """Bytes per second of the AdamW update (28 bytes of traffic per parameter)."""
    from mpi_tp.core.params import make_param
    p = make_param("calibrate", (n,), "float32", init="zeros")
    opt = AdamW([p])
    opt.step()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t)
    return n * 28 / min(ts)


ALLREDUCE_BYTES = (2**10, 2**14, 2**17, 2**20, 2**21, 2**22)     # the sizes of activations here


def time_allreduces(comm, sizes=ALLREDUCE_BYTES, repeats=10) -> list:
    """[[n, seconds]]: the fastest of `repeats` all-reduces of n buffer bytes (float32) over comm,
    each timed as its slowest rank saw it."""
    rows = []
    for n in sizes:
        x = numpy.ones(n // 4, dtype=numpy.float32)
        ts = []
        for _ in range(repeats):
            comm.Barrier()
            t = MPI.Wtime()
            comm.Allreduce(MPI.IN_PLACE, x)
            ts.append(comm.allreduce(MPI.Wtime() - t, op=MPI.MAX))
        rows.append([n, min(ts)])
    return rows


def fit_ring(points, T: int) -> tuple[float, float]:
    """(alpha, bw) of t = 2 (T-1) alpha + 2 (T-1)/T n / bw over [[n, seconds]]: steps 2 (T-1) multiply
    alpha, wire bytes 2 (T-1)/T n multiply beta = 1 / bw. Least squares of the relative error (each row
    divided by its time): plain least squares let the largest messages' milliseconds swamp the small
    ones' microseconds, and gave alpha 25 us where a 1 KB all-reduce took 7.3 us."""
    t = numpy.array([s for _, s in points])
    A = numpy.array([[2 * (T - 1), 2 * (T - 1) / T * n] for n, _ in points]) / t[:, None]
    coef, *_ = numpy.linalg.lstsq(A, numpy.ones(len(points)), rcond=None)
    alpha, beta = max(coef[0], 1e-7), max(coef[1], 1e-12)
    return float(alpha), float(1 / beta)


def fit_allreduce(comm) -> tuple[float, float]:
    """(alpha, bw) of the ring model from timed all-reduces over comm (None, None for one rank)."""
    return (None, None) if comm.Get_size() == 1 else fit_ring(time_allreduces(comm), comm.Get_size())


def layer_overhead(steps=9) -> float:
    """Seconds per layer and micro-batch that do not depend on its size: (step with 5 blocks - step
    with 1) / 4, for a model too small for its arithmetic to count."""
    (_, one), (_, five) = measure_steps(steps, [(32, 2, 1, 8, 1), (32, 2, 5, 8, 1)])
    return max(0.0, (five - one) / 4)


def calibrate(comm, name="this-machine") -> Machine:
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    per_node = local.Get_size()
    local.Free()
    mem_bw = comm.allreduce(optimizer_bandwidth(), op=MPI.MIN)
    G = gemm_rate(comm)
    curve = gemm_curve(comm)
    overlap = overlap_fraction(comm)
    overhead = comm.allreduce(layer_overhead(), op=MPI.MAX)
    comm.Barrier()
    runs = measure_steps()
    times = [comm.allreduce(t, op=MPI.MAX) for _, t in runs]     # the slowest rank's, ranks run at once
    probe = Machine(name, per_node, gemm_flops=G, elem_rate=1.0, mem_bw=mem_bw, mem_bytes=0, intra_alpha=0,
                    intra_bw=1, inter_alpha=0, inter_bw=1)
    elements, rest = [], []
    for (w, _), t in zip(runs, times):
        lay = Plan(micro_batch=w.global_batch)
        gemm_s = step_time(replace(probe, ew_rep=0, ew_par=0, ew_att=0), w, lay)["compute"]
        elements.append(step_time(replace(probe, gemm_flops=1e30), w, lay)["compute"])      # elements (E = 1)
        rest.append(t - gemm_s - w.n_layer * overhead - step_time(probe, w, lay)["optimizer"])
    elements, rest = numpy.array(elements), numpy.array(rest)
    inv_e = float(elements @ rest / (elements @ elements))         # least squares through the origin
    points = time_allreduces(comm) if comm.Get_size() > 1 else []
    alpha, bw = fit_ring(points, comm.Get_size()) if points else (None, None)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return Machine(
        name=name, ranks_per_node=per_node, gemm_flops=G, elem_rate=float(1 / max(inv_e, 1e-15)), mem_bw=mem_bw, mem_bytes=pages / per_node,
        gemm_curve=curve, layer_overhead=overhead, dp_overlap=overlap, allreduce_points=points,
        intra_alpha=alpha or 1e-6, intra_bw=bw or 1e10, inter_alpha=alpha or 1e-6, inter_bw=bw or 1e10,
        bytes_per_value=4, state_bytes_per_param=16, activations="mpi_tp",
        source=f"mpi-tp calibrate, {comm.Get_size()} rank(s), {time.strftime('%Y-%m-%d %H:%M')}, "
               f"{library_version()}, numpy {numpy.__version__}")


def add_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="measure this machine's constants for the cost model (mpi-tp plan)",
                       description=__doc__.split("\n\n")[0])
    c.add_argument("--out", default="machine.json", help="where to write the machine description (JSON)")
    c.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    c.add_argument("--name", default="this-machine", help="the machine's name in the file")
    c.set_defaults(run=cmd_calibrate)


def summary(m: Machine, T: int) -> str:
    """What `mpi-tp calibrate` prints: the constants, then each timed all-reduce against the fitted line."""
    lines = [(f"GEMM {m.gemm_flops / 1e9:.1f} GFLOP/s and elementwise {m.elem_rate / 1e9:.2f} G elements/s per rank "
             f"(+{m.layer_overhead * 1e6:.0f} us per layer and micro-batch), GEMM at {m.gemm_curve[0][0]} rows "
             f"{m.gemm_curve[0][1] / 1e9:.1f} GFLOP/s, overlap {m.dp_overlap:.2f}, "
             f"optimizer {m.mem_bw / 1e9:.1f} GB/s, "
             f"all-reduce alpha {m.intra_alpha * 1e6:.1f} us, bw {m.intra_bw / 1e9:.2f} GB/s (beta = 1 / bw = "
             f"{1e9 / m.intra_bw:.3f} ns per byte), "
             f"{m.ranks_per_node} rank(s) per node")]
    for n, seconds in m.allreduce_points:                # the points of the fit: docs/costmodel.md redoes it
        model = 2 * (T - 1) * m.intra_alpha + 2 * (T - 1) / T * n / m.intra_bw
        lines.append(f"  all-reduce of n = {n:>9,} B over T = {T}: {seconds * 1e6:8.1f} us measured, "
                     f"{model * 1e6:8.1f} us = 2 (T-1) alpha + 2 (T-1)/T n beta")
    return "\n".join(lines)


def prepare_out(path: str, overwrite: bool) -> None:
    """Make sure the measurement can be written before measuring (rank 0): an existing file only with
    --overwrite, never a folder; a missing parent folder is created, as `train --out` creates its own."""
    refuse_to_replace(path, overwrite, "calibrate --out")
    if os.path.isdir(path):
        raise UserError(f"calibrate --out {path} is a folder: name a file, e.g. --out {os.path.join(path, 'machine.json')}")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UserError(f"calibrate --out {path}: cannot create the folder {folder} ({e.strerror}): "
                        "choose a path in a folder you can write") from None
    if not os.access(folder, os.W_OK):
        raise UserError(f"calibrate --out {path}: the folder {folder} is not writable: choose a path in a folder "
                        "you can write")


def cmd_calibrate(args, comm) -> int:
    collective_setup(lambda: prepare_out(args.out, args.overwrite)
                     if comm.Get_rank() == 0 else None, comm=comm)      # before the measuring
    m = calibrate(comm, args.name)
    if comm.Get_rank() == 0:
        m.save(args.out)
    rank0_print(f"wrote {args.out}: " + summary(m, comm.Get_size()), comm=comm)
    return 0
