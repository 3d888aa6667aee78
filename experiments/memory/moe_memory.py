"""Memory per rank of mixture-of-experts layouts, measured against the planner's estimate (issue 41; Megatron-LM's
users report its MoE estimates ignore EP and ETP: #1784, #4050, #2439).

    mpiexec -n 2 python -m mpi4py experiments/memory/moe_memory.py       # the 2-rank layouts (and writes the table)
    mpiexec -n 2 python -m mpi4py experiments/memory/moe_memory.py --only dp2-ep2-zero3   # some of them
    python experiments/memory/moe_memory.py                             # the 1-rank one
    python experiments/memory/moe_memory.py --table                     # the table again, from the JSON lines

Each layout: a GPT-2-style MoE model (C 256, H 4, L 4, S 128, B 4 per replica, vocabulary 256, every block MoE,
E 8 experts, float32) built at the layout, one library training step (mpi_tp.training.step) to make every
buffer, then one more under a MemoryMeter (mpi_tp.core.memory: parameters, gradients, optimizer, activations,
... each array once, at the probe points, and one more inside each block's backward: probed_backward); the
peak of the rank that peaks highest, beside mpi_tp.planning.memory.memory_per_rank for the same layout (this machine's calibration,
experiments/planner/results/machine_2ranks.json) and the error. Lines go to results/moe_memory.jsonl (a layout
run again replaces its line); the table to docs/performance.md#mixture-of-experts-memory-per-rank.
The routing of an untrained model is not balanced: the estimate assumes every rank computes k N / ep rows, the
busiest rank computes more (its max/mean load is in each line).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "moe_memory.jsonl")
MACHINE = os.path.join(HERE, "..", "planner", "results", "machine_2ranks.json")
C, H, L, S, B, E = 256, 4, 4, 128, 4, 8

LAYOUTS = {   # name: (ranks, Topology sizes and options)
    "serial-top2": (1, dict(k=2)),
    "dp2-ep2-top2": (2, dict(dp=2, ep=2, k=2)),
    "dp2-ep2-top1": (2, dict(dp=2, ep=2, k=1)),
    "dp2-ep2-zero1": (2, dict(dp=2, ep=2, k=2, zero=1)),
    "dp2-etp2": (2, dict(dp=2, etp=2, k=2)),
    "tp2-etp2": (2, dict(tp=2, k=2)),
    "tp2-etp1-ep2": (2, dict(tp=2, ep=2, etp=1, k=2)),
    "tp2-etp1-ep2-sp": (2, dict(tp=2, ep=2, etp=1, k=2, sp=True)),
    "dp2-ep2-shared1": (2, dict(dp=2, ep=2, k=2, shared=1)),
    "dp2-ep2-allgather": (2, dict(dp=2, ep=2, k=2, dispatcher="allgather")),
    "dp2-ep1-top2": (2, dict(dp=2, k=2)),
    "dp2-ep2-zero2": (2, dict(dp=2, ep=2, k=2, zero=2)),
    "dp2-ep2-zero3": (2, dict(dp=2, ep=2, k=2, zero=3)),
    "dp2-ep2-capacity0.5": (2, dict(dp=2, ep=2, k=2, capacity=0.5)),
    "dp2-dense-zero2": (2, dict(dp=2, E=0, k=1, zero=2)),      # controls: the dense model, this meter's probes
    "dp2-dense-zero3": (2, dict(dp=2, E=0, k=1, zero=3)),
}


def probed_backward(backward):
    """A block's MLP (or MoE) backward that samples the meter when it returns: the block's own gradients held
    whole (ZeRO-2 and 3 hold them from the backward that reaches the block: mpi_tp.parallel.grad_release), its
    parameters gathered (ZeRO-3), its attention's and the blocks' below activations still kept. The engine's
    probes ("B") sample after the whole backward, when the activations are gone, so without this one a meter
    sees ZeRO-2/3's forward peak ("loss") alone."""
    from mpi_tp.core import memory

    def run(dout):
        dx = backward(dout)
        memory.probe("block backward")
        return dx
    return run


def measure(name: str, comm) -> dict:
    import numpy
    from mpi4py import MPI

    from mpi_tp.commands.bench import accounting
    from mpi_tp.core.memory import MemoryMeter
    from mpi_tp.model.config import GPTConfig
    from mpi_tp.model.gpt import GPT
    from mpi_tp.parallel.data_parallel import GradReducer
    from mpi_tp.parallel.pipeline.stage import as_stage
    from mpi_tp.parallel.topology import Topology
    from mpi_tp.training.optim import AdamW
    from mpi_tp.training.step import train_step
    o = LAYOUTS[name][1]
    topo = Topology.create(comm, tp=o.get("tp", 1), dp=o.get("dp", 1), ep=o.get("ep", 1), etp=o.get("etp", 0))
    cfg = GPTConfig(vocab_size=256, block_size=S, n_layer=L, n_head=H, n_embd=C, moe_experts=o.get("E", E),
                    moe_top_k=o["k"],
                    moe_shared_experts=o.get("shared", 0), moe_dispatcher=o.get("dispatcher", "alltoall"),
                    moe_capacity=o.get("capacity", 0.0))
    model = GPT(cfg, topo, dtype="float32", seed=0, sequence_parallel=o.get("sp", False))
    zero = o.get("zero", 0)
    reducer = GradReducer(model, topo.dpcp, distributed=zero >= 1, stage=max(zero, 1))
    opt = AdamW(model.parameters(), lr=1e-4, reducer=reducer)
    rng = numpy.random.default_rng(0)
    x = rng.integers(0, 256, (B * topo.dp.size, S))
    y = rng.integers(0, 256, (B * topo.dp.size, S))
    rows = topo.replica_rows(B)
    train_step(model, opt, x, y, rows, 1, grad_clip=1.0, reducer=reducer)       # every buffer made
    for block in model.h:                               # a probe inside each block's backward (probed_backward)
        block.mlp.backward = probed_backward(block.mlp.backward)
    meter = MemoryMeter(as_stage(model, 1), opt, reducer)
    with meter:
        train_step(model, opt, x, y, rows, 1, grad_clip=1.0, reducer=reducer)
    report = accounting.measured(meter, comm)
    loads = numpy.array([m.stats["tokens_per_expert"] for m in model.moe_layers()], dtype=float).reshape(-1, E)
    loads = comm.allreduce(loads, op=MPI.SUM) if topo.dp.size > 1 else loads
    imbalance = float((loads.max(axis=1) / loads.mean(axis=1)).mean()) if len(loads) else 1.0
    admitted = float(loads.sum() / (len(loads) * B * topo.dp.size * S * o["k"])) if len(loads) else 1.0
    topo.free()
    return {"report": report, "imbalance": imbalance, "admitted": admitted, "dp": topo.dp.size}


def estimate(name: str, dp: int) -> dict:
    from mpi_tp.planning.costmodel import Plan, Workload
    from mpi_tp.planning.machines import Machine, with_precision
    from mpi_tp.planning.memory import memory_per_rank
    o = LAYOUTS[name][1]
    m = with_precision(Machine.load(MACHINE), "fp32")
    w = Workload(L, C, H, S, B * dp, vocab=256, experts=o.get("E", E), top_k=o["k"], shared_experts=o.get("shared", 0),
                 capacity=o.get("capacity", 0.0))
    lay = Plan(tp=o.get("tp", 1), dp=dp, ep=o.get("ep", 1), etp=o.get("etp", 0), micro_batch=B,
               sp=o.get("sp", False), zero=o.get("zero", 0), dispatcher=o.get("dispatcher", "alltoall"))
    return {k: float(v) for k, v in memory_per_rank(m, w, lay).items()}


def table(rows: list) -> str:
    mib = (lambda b: f"{b / 2**20:.2f}")
    out = ["| layout | max/mean load | parameters | gradients | optimizer | activations (+ messages) | measured peak "
           "| estimate: parameters, gradients, optimizer, activations + logits | estimate | error |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, e = r["measured"]["peak"], r["estimate"]
        kept = f" ({r['admitted']:.2f} admitted)" if r.get("admitted", 1.0) < 1 else ""
        out.append(f"| {r['layout']} | {r['imbalance']:.2f}{kept} | {mib(p['parameters'])} | {mib(p['gradients'])} | "
                   f"{mib(p['optimizer'])} | {mib(p['activations'])} (+{mib(p['communication'])}) | "
                   f"{mib(p['total'])} | {mib(e['parameters'])}, {mib(e['gradients'])}, {mib(e['optimizer'])}, "
                   f"{mib(e['activations'])} + {mib(e['logits'])} | {mib(e['total'])} | {100 * r['error']:+.1f}% |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", action="store_true", help="print the table from the JSON lines, run nothing")
    ap.add_argument("--only", help="comma-separated layouts (default: all of this many ranks)")
    args = ap.parse_args()
    rows = []
    if os.path.exists(OUT):
        with open(OUT) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    if not args.table:
        from mpi4py import MPI

        from mpi_tp.core.runtime import machine_text
        comm = MPI.COMM_WORLD
        names = args.only.split(",") if args.only else list(LAYOUTS)
        unknown = [n for n in names if n not in LAYOUTS]
        if unknown:
            sys.exit(f"unknown layouts {unknown}: choose from {', '.join(LAYOUTS)}")
        for name, (ranks, _) in ((n, LAYOUTS[n]) for n in names):
            if ranks != comm.Get_size():
                continue
            got = measure(name, comm)
            est = estimate(name, got["dp"])
            peak = got["report"]["peak"]["total"]
            row = {"layout": name, "ranks": ranks, "measured": got["report"], "estimate": est,
                   "error": est["total"] / peak - 1, "imbalance": got["imbalance"],
                   "admitted": got["admitted"], "machine": machine_text(),
                   "date": time.strftime("%Y-%m-%d %H:%M"), "load": os.getloadavg()[0],
                   "command": f"{'mpiexec -n 2 python -m mpi4py ' if ranks > 1 else 'python '}"
                              "experiments/memory/moe_memory.py"}
            rows = [r for r in rows if r["layout"] != name] + [row]
            if comm.Get_rank() == 0:
                print(f"{name}: measured {peak / 2**20:.2f} MiB, estimate {est['total'] / 2**20:.2f} MiB "
                      f"({100 * row['error']:+.1f}%), max/mean load {got['imbalance']:.2f}", flush=True)
        if comm.Get_rank() != 0:
            return
        order = list(LAYOUTS)
        rows.sort(key=lambda r: order.index(r["layout"]))
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        with open(OUT, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))


if __name__ == "__main__":
    sys.exit(main())
