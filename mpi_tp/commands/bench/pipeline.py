"""`mpi-tp bench --pp P`: timed training steps of a pipelined layout, with the bubble and the bytes
sent between stages measured in the same run.

    mpiexec -n 2 mpi-tp bench --pp 2 --micro-batches 8 --shape a
    mpiexec -n 4 mpi-tp bench --tp 2 --pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2

The shape's batch B is the micro-batch size: a step is M micro-batches of B
sequences per replica. Each timed step is also traced (mpi_tp.parallel.trace):
the bubble is the span of the schedule's actions over the busiest stage's time
in them, minus one, next to the formula (mpi_tp.planning.bubble: (P - 1) / M,
(P - 1) / (v M) for the interleaved schedule, the zero-bubble ones' at the run's
measured share of W) and to the schedule played at the run's mean F, B and W
times without communication (schedules.simulate); the point-to-point bytes are what each rank sent to the next or
previous stage, next to the formula (p2p_formula: M activations forward from
every chunk but the model's last, M gradients back from every chunk but its
first, B S C / T values each). receive_wait_ms_per_stage is the median time a
step spent blocked in receives on each stage (engine.waited), with
receives_posted_ahead actions' receives posted ahead (MPI_TP_PIPE_PREPOST). The
other fields are those of `mpi-tp bench`.
"""
from __future__ import annotations

import time

import numpy
from mpi4py import MPI

from mpi_tp.commands.bench import accounting
from mpi_tp.core.memory import MemoryMeter
from mpi_tp.model.chunks import build_stage
from mpi_tp.model.config import GPTConfig
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.pipeline.actions import global_chunk
from mpi_tp.parallel.pipeline.schedules import SPLIT, V_SHAPED, schedule, simulate
from mpi_tp.parallel.topology import Topology, split_sizes
from mpi_tp.parallel.trace import Trace
from mpi_tp.planning.bubble import bubble_fraction
from mpi_tp.training.optim import AdamW
from mpi_tp.training.step import train_step


def p2p_formula(stage: int, P: int, v: int, M: int, values: int, itemsize: int, v_shape: bool = False) -> int:
    """Bytes rank `stage` sends in one step: each of its chunks but the model's last sends M
    activations forward, each but the model's first sends M gradients back; `values` per message.
    In the V (zb-v) chunk P - 1's output and chunk P's input gradient stay on rank P - 1."""
    chunks = [global_chunk(stage, c, P, v_shape) for c in range(v)]
    here = (P - 1, P) if v_shape else ()                        # (from, to) handed over in memory
    messages = sum(M for g in chunks if g < P * v - 1 and (g, g + 1) != here) + \
        sum(M for g in chunks if g > 0 and (g - 1, g) != here)
    return messages * values * itemsize


def ideal_bubble(comm, stage, durations: dict) -> dict:
    """The bubble the schedule would have without communication, at this run's action times (the
    busiest stage's mean F, B and W): by formula (mpi_tp.planning.bubble, W's share w of the work
    measured) and by playing the schedule's action lists (schedules.simulate)."""
    mean = {k: comm.allreduce(float(numpy.mean(d)) if d else 0.0, op=MPI.MAX) for k, d in durations.items()}
    t_f, t_b, t_w = mean["F"], mean["B"] + mean["W"], mean["W"]                      # t_b: a whole backward
    name, P, M, v = stage.schedule_name, stage.topo.pp.size, stage.M, stage.v
    w = t_w / (t_f + t_b)
    plan = schedule(name, P, M, v)
    sim = simulate(plan, t_f, t_b, t_w if name in SPLIT else None, v_shape=name in V_SHAPED)
    return {"formula": bubble_fraction(name if name in SPLIT else None, P, v, M, w), "simulated": sim["bubble"],
            "w_share": w}


def run_pipeline_shape(comm, C, H, L, S, B, steps, warmup, dtype, tp, pp, dp, micro_batches, schedule,
                       virtual=1, sequence_parallel=False, seed=0, recompute="none", overlap_dp=False,
                       zero=0, first_stage_layers=None, last_stage_layers=None) -> dict:
    """Time `steps` pipelined training steps at one shape (after `warmup` untimed ones).
    overlap_dp: start the data-parallel all-reduces during each chunk's last backward (default:
    after the schedule); zero 1: the distributed optimizer over dp. After the timed steps one more
    step runs with a MemoryMeter (mpi_tp.core.memory; untimed): memory_measured is its peak by category.
    first_stage_layers / last_stage_layers: the end stages' blocks (layer_ranges; None: an even share);
    blocks_per_stage says what each stage held."""
    from mpi_tp.commands.bench.yardsticks import (  # the same yardsticks as `mpi-tp bench`
        gemm_peak,
        model_flops,
    )
    topo = Topology.create(comm, tp=tp, pp=pp, dp=dp)
    stage = build_stage(GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=S), topo, dtype, seed,
                        sequence_parallel, schedule, micro_batches, virtual, recompute, first_stage_layers,
                        last_stage_layers)
    stage.count_activations = True
    reducer = GradReducer(stage, topo.dp, overlap=overlap_dp, distributed=zero >= 1, stage=max(zero, 1))
    opt = AdamW(stage.parameters(), lr=1e-4, reducer=reducer)
    M = micro_batches
    rng = numpy.random.default_rng(seed)
    x, y = rng.integers(0, 256, (B * M * dp, S)), rng.integers(0, 256, (B * M * dp, S))
    rows = topo.replica_rows(B * M)
    step_s, bubbles, sent, waited = [], [], [], []
    durations = {"F": [], "B": [], "W": []}                   # this rank's traced actions (microseconds)
    for i in range(warmup + steps):
        topo.stats.reset()
        trace = Trace(comm) if i >= warmup else None           # the barrier also lines the ranks up
        topo.stats.trace = trace
        t0 = time.perf_counter()
        train_step(stage, opt, x, y, rows, grad_clip=1.0, reducer=reducer)        # the library's step
        t = time.perf_counter() - t0
        topo.stats.trace = None
        if trace is None:
            continue
        step_s.append(comm.allreduce(t, op=MPI.MAX))
        acts = [e for e in trace.events if e["name"] in ("F", "B", "W")]
        first = comm.allreduce(min(e["ts"] for e in acts), op=MPI.MIN)
        last = comm.allreduce(max(e["ts"] + e["dur"] for e in acts), op=MPI.MAX)
        busy = comm.allreduce(sum(e["dur"] for e in acts), op=MPI.MAX)
        bubbles.append((last - first - busy) / busy)
        for e in acts:
            durations[e["name"]].append(e["dur"])
        sent.append(topo.stats.snapshot().get("pp/send", {}).get("bytes", 0))
        waited.append(stage.engine.waited)
    meter = MemoryMeter(stage, opt, reducer)
    with meter:                                             # one more step, untimed, sampled
        train_step(stage, opt, x, y, rows, grad_clip=1.0, reducer=reducer)
    med = float(numpy.median(step_s))
    flops = model_flops(C, L, S, B * M) * dp
    peak = comm.allreduce(gemm_peak(comm), op=MPI.SUM) / comm.Get_size()
    if sequence_parallel:                                        # what crosses per message: 1/T of B S C
        values = B * split_sizes(S, topo.tp.size)[topo.tp.rank] * C
    else:
        values = split_sizes(B * S * C, tp)[topo.tp.rank]
    result = {
        "shape": {"n_embd": C, "n_head": H, "n_layer": L, "block_size": S, "batch": B}, "tp": tp, "pp": pp, "dp": dp,
        "schedule": schedule, "virtual_stages": virtual, "micro_batches": M, "sequence_parallel": sequence_parallel,
        "dtype": dtype, "steps": steps,
        "step_ms": {"median": 1e3 * med, "min": 1e3 * min(step_s), "max": 1e3 * max(step_s)},
        "tokens_per_s": B * M * S * dp / med, "model_gflop_per_step": flops / 1e9,
        "model_gflops_per_rank": flops / med / comm.Get_size() / 1e9, "gemm_peak_gflops_per_rank": peak,
        "bubble": {"measured": float(numpy.median(bubbles)), **ideal_bubble(comm, stage, durations)},
        "p2p_bytes_per_step": {"measured": int(numpy.median(sent)),
                               "formula": p2p_formula(topo.pp.rank, pp, virtual, M, values,
                                                      numpy.dtype(dtype).itemsize, schedule in V_SHAPED)},
    }
    result["fraction_of_gemm_peak"] = result["model_gflops_per_rank"] / peak
    result["recompute"] = recompute
    result["zero"] = int(zero) if dp > 1 else 0
    result["memory_measured"] = accounting.measured(meter, comm)      # by category at the peak (core.memory)
    result["dp_overlapped"] = bool(overlap_dp and dp > 1)       # the DP all-reduces ran during the schedule
    result["receives_posted_ahead"] = stage.engine.prepost     # actions ahead (0: post and wait at once)
    result["receive_wait_ms_per_stage"] = [1e3 * w for w in topo.pp.comm.allgather(float(numpy.median(waited)))]
    result["blocks_per_stage"] = topo.pp.comm.allgather(len(stage.h))
    result["peak_activation_mb_per_stage"] = [b / 2**20 for b in topo.pp.comm.allgather(stage.peak_activation_bytes)]
    topo.free()
    return result


def print_pipeline(r: dict) -> str:
    s = r["shape"]
    return (f"C={s['n_embd']} H={s['n_head']} L={s['n_layer']} S={s['block_size']} B={s['batch']} tp={r['tp']} "
            f"pp={r['pp']} dp={r['dp']} {r['schedule']} M={r['micro_batches']} v={r['virtual_stages']}: step "
            f"{r['step_ms']['median']:.1f} ms (min {r['step_ms']['min']:.1f}), {r['tokens_per_s']:,.0f} tok/s, "
            f"{100 * r['fraction_of_gemm_peak']:.0f}% of the GEMM peak\n"
            f"  bubble {r['bubble']['measured']:.3f} (formula {r['bubble']['formula']:.3f}, the schedule played at "
            f"this run's F/B/W times {r['bubble']['simulated']:.3f}); sent to other stages "
            f"{r['p2p_bytes_per_step']['measured']:,} bytes per step on rank 0 (formula "
            f"{r['p2p_bytes_per_step']['formula']:,})\n"
            f"  blocks per stage: {', '.join(map(str, r['blocks_per_stage']))}; activations held at the peak, per "
            f"stage: "
            f"{', '.join(f'{mb:.1f}' for mb in r['peak_activation_mb_per_stage'])} MB (recompute {r['recompute']})\n"
            f"  {accounting.describe(r['memory_measured'])}")
