"""`mpi-tp calibrate`: measure this machine's constants for the cost model.

    mpiexec -n 2 mpi-tp calibrate --out machine.json     # then: mpi-tp plan --machine machine.json ...

- GEMM rate: the matrix products of a transformer layer (q/k/v, projection, MLP;
  forward, dX and dW) at the calibration shapes, timed on every rank at once (ranks
  share the machine as they will in a run).
- Elementwise rate: timed training steps of those shapes at tensor-parallel size 1
  on every rank at once; what the GEMMs and the optimizer do not explain, divided
  by the model's count of elementwise work (a one-parameter least-squares fit).
- Memory bandwidth of the optimizer: a timed AdamW update of 8M parameters.
- Collectives: all-reduce of 1 KB..16 MB over the world, fitted to the ring
  model 2(p-1) alpha + 2(p-1)/p n / bw (the same link is used for "intra" and
  "inter" unless the job spans nodes, where the fit is over the whole world).
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy
from mpi4py import MPI

from mpi_tp.core.runtime import rank0_print
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.planning.costmodel import Layout, Machine, Workload, step_time
from mpi_tp.training.optim import AdamW

SHAPES = [(128, 2, 2, 64, 4), (256, 4, 2, 64, 4), (256, 4, 2, 128, 4), (384, 6, 2, 128, 4)]   # C, H, L, S, B


# Noise on a shared machine only ever slows a run down, so the calibration keeps the fastest
# of several repeats: the machine's speed when nothing else disturbs it.


def _fastest_step(model, opt, x, y, steps):
    ts = []
    for i in range(steps + 1):
        t = time.perf_counter()
        model.zero_grad()
        model.forward(x, y)
        model.backward()
        opt.step()
        if i:
            ts.append(time.perf_counter() - t)
    return min(ts)


def measure_steps(steps=5) -> list[tuple]:
    """[(Workload, seconds per step)] on this rank, tp = 1."""
    out = []
    for C, H, L, S, B in SHAPES:
        model = GPT(GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=S), Topology.serial(), dtype="float32")
        opt = AdamW(model.parameters())
        rng = numpy.random.default_rng(0)
        x, y = rng.integers(0, 256, (B, S)), rng.integers(0, 256, (B, S))
        out.append((Workload(L, C, H, S, B), _fastest_step(model, opt, x, y, steps)))
    return out


def gemm_rate(comm, repeats=7) -> float:
    """FLOP/s of a layer's matrix products at the calibration shapes, all ranks at once (fastest)."""
    rng = numpy.random.default_rng(0)
    flops, seconds = 0.0, 0.0
    for C, H, L, S, B in SHAPES:
        N = B * S
        for K, M in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)):
            x = rng.standard_normal((N, K), dtype=numpy.float32)
            w = rng.standard_normal((K, M), dtype=numpy.float32)
            d = rng.standard_normal((N, M), dtype=numpy.float32)
            x @ w
            ts = []
            for _ in range(repeats):
                comm.Barrier()
                t = time.perf_counter()
                x @ w, d @ w.T, x.T @ d                      # forward, dX, dW
                ts.append(time.perf_counter() - t)
            flops += 3 * 2 * N * K * M
            seconds += min(ts)
    return comm.allreduce(flops / seconds, op=MPI.MIN)


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


def fit_allreduce(comm) -> tuple[float, float]:
    """(alpha, bw) of the ring model from timed all-reduces over comm (None, None for one rank)."""
    p = comm.Get_size()
    if p == 1:
        return None, None
    rows = []
    for n in (2**10, 2**14, 2**17, 2**20, 2**21, 2**22):          # the sizes of activations here
        x = numpy.ones(n // 4, dtype=numpy.float32)
        ts = []
        for _ in range(10):
            comm.Barrier()
            t = MPI.Wtime()
            comm.Allreduce(MPI.IN_PLACE, x)
            ts.append(comm.allreduce(MPI.Wtime() - t, op=MPI.MAX))
        rows.append((n, min(ts)))
    A = numpy.array([[2 * (p - 1), 2 * (p - 1) / p * n] for n, _ in rows])
    coef, *_ = numpy.linalg.lstsq(A, numpy.array([t for _, t in rows]), rcond=None)
    alpha, inv_bw = max(coef[0], 1e-7), max(coef[1], 1e-12)
    return float(alpha), float(1 / inv_bw)


def calibrate(comm, name="this-machine") -> Machine:
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    per_node = local.Get_size()
    local.Free()
    mem_bw = comm.allreduce(optimizer_bandwidth(), op=MPI.MIN)
    G = gemm_rate(comm)
    comm.Barrier()
    runs = measure_steps()
    times = [comm.allreduce(t, op=MPI.MAX) for _, t in runs]     # the slowest rank's, ranks run at once
    probe = Machine(name, per_node, gemm_flops=G, elem_rate=1.0, mem_bw=mem_bw, mem_bytes=0, intra_alpha=0,
                    intra_bw=1, inter_alpha=0, inter_bw=1)
    elements, rest = [], []
    for (w, _), t in zip(runs, times):
        lay = Layout(micro_batch=w.global_batch)
        gemm_s = step_time(replace(probe, ew_rep=0, ew_par=0, ew_att=0), w, lay)["compute"]
        elements.append(step_time(replace(probe, gemm_flops=1e30), w, lay)["compute"])      # elements (E = 1)
        rest.append(t - gemm_s - step_time(probe, w, lay)["optimizer"])
    elements, rest = numpy.array(elements), numpy.array(rest)
    inv_e = float(elements @ rest / (elements @ elements))         # least squares through the origin
    alpha, bw = fit_allreduce(comm)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return Machine(
        name=name, ranks_per_node=per_node, gemm_flops=G, elem_rate=float(1 / max(inv_e, 1e-15)), mem_bw=mem_bw, mem_bytes=pages / per_node,
        intra_alpha=alpha or 1e-6, intra_bw=bw or 1e10, inter_alpha=alpha or 1e-6, inter_bw=bw or 1e10,
        bytes_per_value=4, state_bytes_per_param=16, activations="mpi_tp",
        source=f"mpi-tp calibrate, {comm.Get_size()} rank(s), {time.strftime('%Y-%m-%d %H:%M')}, "
               f"{MPI.Get_library_version().splitlines()[0].strip()}, numpy {numpy.__version__}")


def add_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="measure this machine's constants for the cost model (mpi-tp plan)",
                       description=__doc__.split("\n\n")[0])
    c.add_argument("--out", default="machine.json", help="where to write the machine description (JSON)")
    c.add_argument("--name", default="this-machine", help="the machine's name in the file")
    c.set_defaults(run=cmd_calibrate)


def cmd_calibrate(args, comm) -> int:
    m = calibrate(comm, args.name)
    if comm.Get_rank() == 0:
        m.save(args.out)
    rank0_print(f"wrote {args.out}: GEMM {m.gemm_flops / 1e9:.1f} GFLOP/s and elementwise "
                f"{m.elem_rate / 1e9:.2f} G elements/s per rank, optimizer {m.mem_bw / 1e9:.1f} GB/s, "
                f"all-reduce alpha {m.intra_alpha * 1e6:.1f} us, bw {m.intra_bw / 1e9:.2f} GB/s, "
                f"{m.ranks_per_node} rank(s) per node", comm=comm)
    return 0
