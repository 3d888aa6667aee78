"""`mpi-tp bench`'s training steps, timed with the machine's own limits measured in the same run
(run_shape, print_table; the command's options and dispatch: mpi_tp.commands.bench.command).

Per step: the library's training step (mpi_tp.training.step: forward + loss,
backward, gradient clipping and AdamW), after warm-up steps; a step's time is the
slowest rank's, its phases the step's own trace spans. Model FLOPs follow the PaLM/Megatron
count used by the PyTorch peer (../shared/peers/torch_tp):

    FLOP/step = tokens * (6 * N_mm + 12 * L * C * S),   N_mm = 12 L C^2 + V C

(N_mm: the weights of all matrix products, the tied head included; the second
term is attention's QK^T and AV, forward and backward, over the full S x S). Per
rank it is divided by T. It is set against the GEMM peak measured here, in the
same run, with every rank multiplying at once on its own threads (two concurrent
single-thread GEMMs on 2 cores reach less than twice one).
"""
from __future__ import annotations

import resource
import time

import numpy
from mpi4py import MPI

from mpi_tp.commands.bench import accounting
from mpi_tp.commands.bench.yardsticks import allreduce_overhead, gemm_peak, model_flops
from mpi_tp.core import backend
from mpi_tp.core.memory import MemoryMeter
from mpi_tp.core.params import widen_grads
from mpi_tp.core.precision import dtype_of, precision_of
from mpi_tp.core.runtime import rank0_print
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.comm_stats import wire_bytes_by_role
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.pipeline.stage import as_stage
from mpi_tp.parallel.topology import Topology
from mpi_tp.parallel.trace import Trace
from mpi_tp.planning.activations import activation_bytes_per_layer
from mpi_tp.training.loss_scale import LossScaler
from mpi_tp.training.optim import AdamW
from mpi_tp.training.step import train_step

SHAPES = {  # name: (n_embd, n_head, n_layer, block_size, batch)
    "a": (256, 4, 4, 128, 8),
    "b": (512, 8, 4, 128, 8),
    "c": (1024, 16, 2, 128, 4),
}


def run_shape(comm, C, H, L, S, B, steps=10, warmup=3, dtype="float32", seed=0, dp=1, dp_mode="overlap",
              sequence_parallel=False, zero=0, cp=1, tp=0, fp32_grads=False, recompute="none") -> dict:
    """Time training steps at one shape. dp > 1: data parallelism with B sequences per replica;
    dp_mode "overlap" / "after" (gradient all-reduces during / after the backward pass) or "none"
    (no gradient all-reduce at all: a timing baseline only, the replicas then drift apart);
    zero: the distributed optimizer (reduce-scatter, AdamW on each rank's share, all-gather).
    cp: context parallelism (each sequence over cp ranks, ring attention; the reducer over cp x dp).
    dtype "bfloat16" / "float16": --precision bf16 / fp16 (fp32 masters and moments; accounting:
    bench.accounting; fp16 steps with train's dynamic loss scale, its overflow check included);
    fp32_grads: their gradients in fp32 (train's --fp32-grads: the reduction at 4 bytes a value).
    recompute: "none", "selective" or "full" activation recomputation. After the timed steps one more
    step runs with a MemoryMeter (mpi_tp.core.memory; untimed): memory_measured is its peak by category."""
    topo = Topology.create(comm, tp=tp or None, dp=dp, cp=cp)
    model = GPT(GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=S), topo, dtype=dtype, seed=seed,
                sequence_parallel=sequence_parallel, recompute=recompute)
    params = model.parameters()
    if fp32_grads:
        widen_grads(params)
    reducer = (GradReducer(model, topo.dpcp, overlap=dp_mode == "overlap", distributed=zero >= 1, stage=max(zero, 1))
               if dp_mode != "none" else None)
    opt = AdamW(params, lr=1e-4, reducer=reducer)
    scaler = LossScaler() if dtype == "float16" else None
    rng = numpy.random.default_rng(seed)
    x, y = rng.integers(0, 256, (B * topo.dp.size, S)), rng.integers(0, 256, (B * topo.dp.size, S))
    rows = topo.replica_rows(B)
    model.forward(x[rows], y[rows])                  # untimed: block 0's caches after a forward, largest rank
    acts = comm.allreduce(model.h[0].activation_bytes(), op=MPI.MAX)
    model.backward(grads=reducer.grads() if reducer is not None else None)     # (ZeRO-2: its buffers made)
    phases = {"forward": [], "backward": [], "optimizer": [], "step": []}
    comm_s, comm_bytes, comm_wire, roles = [], [], [], []
    for i in range(warmup + steps):
        topo.stats.reset()
        trace = topo.stats.trace = Trace(synchronize=True)   # each phase's time includes its queued GPU work
        comm.Barrier()
        t0 = time.perf_counter()
        train_step(model, opt, x, y, rows, 1, grad_clip=1.0, reducer=reducer, scaler=scaler)  # the library's step
        backend.synchronize()
        t = time.perf_counter() - t0
        topo.stats.trace = None
        took = {k: sum(e["dur"] for e in trace.events if e["name"] in names) / 1e6
                for k, names in (("forward", ("F",)), ("backward", ("B", "finalize")))}
        took["optimizer"], took["step"] = t - took["forward"] - took["backward"], t     # the norm and the update
        if i >= warmup:
            for k, v in took.items():
                phases[k].append(comm.allreduce(v, op=MPI.MAX))        # the slowest rank's
            comm_s.append({k: v["seconds"] for k, v in topo.stats.snapshot().items()})
            comm_bytes.append(topo.stats.total_bytes())
            comm_wire.append(sum(v["wire_bytes"] for v in topo.stats.snapshot().values()))
            roles.append(wire_bytes_by_role(topo.stats.snapshot(), reducer))
    meter = MemoryMeter(as_stage(model, 1), opt, reducer)
    with meter:                                             # one more step, untimed, sampled
        train_step(model, opt, x, y, rows, 1, grad_clip=1.0, reducer=reducer, scaler=scaler)
    step = numpy.array(phases["step"])
    flops = model_flops(C, L, S, B) * topo.dp.size          # the global batch
    kinds = sorted({k for d in comm_s for k in d})
    comm_med = {k: float(numpy.median([d.get(k, 0.0) for d in comm_s])) for k in kinds}
    peak = gemm_peak(comm)
    peak = comm.allreduce(peak, op=MPI.SUM) / comm.Get_size()
    ar = allreduce_overhead(topo, (B, S, C), dtype_of(dtype))
    memory = accounting.memory_per_rank(params, opt)
    med = float(numpy.median(step))
    result = {
        "shape": {"n_embd": C, "n_head": H, "n_layer": L, "block_size": S, "batch": B}, "tp": topo.tp.size,
        "cp": topo.cp.size,
        "dp": topo.dp.size, "dp_mode": dp_mode if dp > 1 else None, "sequence_parallel": sequence_parallel,
        "dtype": dtype, "precision": precision_of(dtype).name,
        "steps": steps, "step_ms": {"median": 1e3 * med, "min": 1e3 * step.min(),
                                                   "max": 1e3 * step.max()},
        "tokens_per_s": B * S * topo.dp.size / med, "model_gflop_per_step": flops / 1e9,
        "model_gflops_per_rank": flops / med / comm.Get_size() / 1e9, "gemm_peak_gflops_per_rank": peak,
        "phases_ms": {k: 1e3 * float(numpy.median(v)) for k, v in phases.items() if k != "step"},
        "comm_ms": {k: 1e3 * v for k, v in comm_med.items()},
        "comm_bytes_per_step": int(numpy.median(comm_bytes)) if comm_bytes else 0,     # buffer sizes
        "wire_bytes_per_step": int(numpy.median(comm_wire)) if comm_wire else 0,      # sent per rank (ring)
        "allreduce_BSC_ms": {k: 1e3 * v for k, v in ar.items()},
        "peak_rss_mb_per_rank": comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX) / 1024,
        "state_mb_per_rank": memory["total"] / 2**20,                 # weights, grads, masters, moments
        "memory_per_rank": memory,                                     # bytes by kind (bench.accounting)
        "wire_bytes_by_role": accounting.median(roles),               # tp, dp_grads, dp_params: sent per rank
        "optimizer_state_mb_per_rank": sum(a.nbytes for arrays in opt.state.values() for a in arrays) / 2**20,
        "zero": int(zero) if topo.dpcp.size > 1 else 0, "recompute": recompute,
        "memory_measured": accounting.measured(meter, comm),           # by category at the peak (core.memory)
        "activation_bytes_per_layer": acts,                 # block 0's caches after a forward, largest rank
        "activation_bytes_per_layer_formula": activation_bytes_per_layer(
            S / cp, B, C, H, topo.tp.size, sequence_parallel, recompute=recompute,
            value_bytes=dtype_of(dtype).itemsize,               # cp: S / cp positions, ring attention's
            online=True if cp > 1 else None),                   # output and lse, no (S, S) array
        "comm_per_step": {k: {"calls": v["calls"], "bytes": v["bytes"], "wire_bytes": v["wire_bytes"]}
                          for k, v in topo.stats.snapshot().items()},       # the last step's, by group/kind
    }
    result["fraction_of_gemm_peak"] = result["model_gflops_per_rank"] / peak
    result["phases_ms"]["compute"] = (result["phases_ms"]["forward"] + result["phases_ms"]["backward"]
                                      - sum(result["comm_ms"].values()))    # seconds held, none overlapping
    return result


def print_table(r: dict, comm) -> None:
    s = r["shape"]
    ph = r["phases_ms"]
    comm_txt = ", ".join(f"{k} {v:.1f}" for k, v in r["comm_ms"].items()) or "none"
    ar = r["allreduce_BSC_ms"]
    mem, wire = r["memory_per_rank"], r["wire_bytes_by_role"]
    parts = [f"{k} {mem[k] / mem['params']:.2f}" for k in ("weights", "grads", "master", "moments") if mem[k]]
    ar_txt = (f"; one (B,S,C) all-reduce {ar['mpi_tp']:.2f} ms vs bare Allreduce {ar['bare']:.2f} ms"
              if ar else "")
    layout = f"tp={r['tp']}" + (f" cp={r['cp']}" if r.get("cp", 1) > 1 else "") + (f" dp={r['dp']} ({r['dp_mode']})" if r["dp"] > 1 else "") + \
        (" +sp" if r["sequence_parallel"] else "") + (f" +zero{r['zero']}" if r["zero"] else "") + \
        (f" recompute {r['recompute']}" if r["recompute"] != "none" else "")
    rank0_print(
        f"C={s['n_embd']} H={s['n_head']} L={s['n_layer']} S={s['block_size']} B={s['batch']} {layout} "
        f"{r['dtype']}: step {r['step_ms']['median']:.1f} ms (min {r['step_ms']['min']:.1f}, max "
        f"{r['step_ms']['max']:.1f}), {r['tokens_per_s']:,.0f} tok/s\n"
        f"  model {r['model_gflops_per_rank']:.1f} GFLOP/s per rank = {100 * r['fraction_of_gemm_peak']:.0f}% of "
        f"the GEMM peak measured now ({r['gemm_peak_gflops_per_rank']:.1f} GFLOP/s per rank)\n"
        f"  forward {ph['forward']:.1f} ms, backward {ph['backward']:.1f} ms, clip+optimizer "
        f"{ph['optimizer']:.1f} ms; compute {ph['compute']:.1f} ms; communication (ms): {comm_txt}{ar_txt}\n"
        f"  {r['comm_bytes_per_step'] / 1e6:.2f} MB in collectives per step ({r['wire_bytes_per_step'] / 1e6:.2f} MB "
        f"sent per rank by ring algorithms); peak RSS "
        f"{r['peak_rss_mb_per_rank']:.0f} MB per rank (model state {r['state_mb_per_rank']:.0f} MB, of which "
        f"optimizer {r['optimizer_state_mb_per_rank']:.0f} MB)\n"
        f"  activations {r['activation_bytes_per_layer'] / 2**20:.2f} MiB per layer (formula "
        f"{r['activation_bytes_per_layer_formula'] / 2**20:.2f}, docs/parallelism.md#activation-memory)\n"
        f"  {r['precision']}: {mem['bytes_per_param']:.2f} bytes per parameter ({' + '.join(parts)}); sent per rank: "
        f"{', '.join(f'{k} {v / 1e6:.3f} MB' for k, v in wire.items() if not isinstance(v, str))}\n"
        f"  {accounting.describe(r['memory_measured'])}", comm=comm)
