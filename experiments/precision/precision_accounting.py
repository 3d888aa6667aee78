"""Bytes at the real width: activation bytes per layer, wire bytes and memory per rank of `mpi-tp bench`'s
training step at fp32 and at bf16 (fp32 masters), the same layout, beside the planner's estimate for it
(`mpi-tp plan --precision`: mpi_tp.planning.memory with this machine's calibration).

    mpiexec -n 2 python -m mpi4py experiments/precision/precision_accounting.py              # tp 2, dp 2 + ZeRO-1
    python experiments/precision/precision_accounting.py --table                             # the table again

Each layout runs --steps timed steps of shape a (C 256, H 4, L 4, S 128, B 8) in both formats; one JSON line
per run goes to results/precision_accounting.jsonl (machine, date, command in each), and rank 0 prints
docs/precision.md's table. Options: --shape C,H,L,S,B, --steps N, --table (print from the lines, no run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "precision_accounting.jsonl")
MACHINE = os.path.join(HERE, "..", "planner", "results", "machine_2ranks.json")


def planner(r: dict) -> dict:
    """The planner's memory per rank for the run's layout and format (mpi-tp plan --precision)."""
    from mpi_tp.planning.costmodel import Plan, Workload
    from mpi_tp.planning.machines import Machine, with_precision
    from mpi_tp.planning.memory import memory_per_rank
    s = r["shape"]
    m = with_precision(Machine.load(MACHINE), r["precision"])
    w = Workload(s["n_layer"], s["n_embd"], s["n_head"], s["block_size"], s["batch"] * r["dp"], vocab=256)
    mem = memory_per_rank(m, w, Plan(tp=r["tp"], dp=r["dp"], micro_batch=s["batch"], zero=int(r["zero"])))
    return {k: float(v) for k, v in mem.items()}


def table(rows: list) -> str:
    out = [("| layout | format | activations / layer (B) | ratio | formula (B) | dp gradient bytes sent | ratio | "
            "tp bytes sent | ratio | bytes / param | state MB measured | state MB planner | activations MB "
            "(all layers) measured / planner |"), "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        key = (r["tp"], r["dp"], r["zero"])
        w, mem, p = r["wire_bytes_by_role"], r["memory_per_rank"], r["planner_memory_per_rank"]
        b = base.setdefault(key, r)
        ratio = (lambda a, c: f"{a / c:.4f}" if c else "-")
        out.append(f"| tp{r['tp']} dp{r['dp']}{' +zero1' if r['zero'] else ''} | {r['precision']} | "
                   f"{r['activation_bytes_per_layer']:,} | "
                   f"{ratio(r['activation_bytes_per_layer'], b['activation_bytes_per_layer'])} | "
                   f"{r['activation_bytes_per_layer_formula']:,.0f} | {w['dp_grads']:,} | "
                   f"{ratio(w['dp_grads'], b['wire_bytes_by_role']['dp_grads'])} | {w['tp']:,} | "
                   f"{ratio(w['tp'], b['wire_bytes_by_role']['tp'])} | {mem['bytes_per_param']:.2f} | "
                   f"{mem['total'] / 2**20:.3f} | {(p['weights_grads'] + p['optimizer']) / 2**20:.3f} | "
                   f"{r['activation_bytes_per_layer'] * r['shape']['n_layer'] / 2**20:.3f} / "
                   f"{p['activations'] / 2**20:.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="256,4,4,128,8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    if args.table:
        with open(OUT) as f:
            print(table([json.loads(line) for line in f]))
        return
    from mpi4py import MPI

    from mpi_tp.commands.bench.step import run_shape
    from mpi_tp.commands.bench.yardsticks import environment
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    C, H, L, S, B = (int(v) for v in args.shape.split(","))
    env, rows = environment(comm), []
    for tp, dp in ((n, 1), (1, n)) if n > 1 else ((1, 1),):
        for dtype in ("float32", "bfloat16"):
            r = run_shape(comm, C, H, L, S, B, steps=args.steps, warmup=1, dtype=dtype, dp=dp, zero=dp > 1, tp=tp)
            r.update(environment=env, command=f"mpiexec -n {n} python -m mpi4py " + " ".join(sys.argv),
                     planner_memory_per_rank=planner(r), planner_machine=os.path.relpath(MACHINE, HERE))
            rows.append(r)
    if comm.Get_rank() == 0:
        with open(OUT, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(table(rows))


if __name__ == "__main__":
    main()
