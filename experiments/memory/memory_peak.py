"""Memory per rank measured against the planner's estimate: `mpi-tp bench --json`'s memory_measured (the step's
peak by category, mpi_tp.core.memory) beside mpi_tp.planning.memory.memory_per_rank for the same layout.

    python experiments/memory/memory_peak.py                      # every layout below that runs today
    python experiments/memory/memory_peak.py --only zero3         # ZeRO-3, once --zero 3 lands
    python experiments/memory/memory_peak.py --table              # the table again, from the JSON lines

(pp2-zb-h1, pp2-zb-v, pp2-zb-h1-full need the zero-bubble engine, `--schedule zb-h1 / zb-v`: a build
without it prints 'not run' for them.)

Each layout is one `mpiexec -n N python -m mpi_tp bench --custom C,H,L,S,B --steps 1 --warmup 0 --json F ...`
(memory does not depend on timing: one step, then the metered one); the line it writes gets the planner's
estimate (this machine's calibration, experiments/planner/results/machine_2ranks.json, at the run's precision)
and the error, the machine and the command, and goes to results/memory_peak.jsonl (a layout run again replaces
its line). The table (docs/performance.md#memory-per-rank-measured-against-the-estimate) compares the peak's total with the estimate's
total; categories: parameters, gradients, optimizer state (+ the optimizer's block scratch, which the planner
does not count), activations (+ the pipeline's messages in flight) against activations + logits.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "memory_peak.jsonl")
MACHINE = os.path.join(HERE, "..", "planner", "results", "machine_2ranks.json")
SHAPE = "256,4,4,128,4"                                     # C, H, L, S, B (vocabulary 256)

LAYOUTS = {   # name: (ranks, bench options)
    "zero0": (2, "--tp 1 --dp 2"),
    "zero1": (2, "--tp 1 --dp 2 --zero 1"),
    "zero2": (2, "--tp 1 --dp 2 --zero 2"),
    "zero3": (2, "--tp 1 --dp 2 --zero 3"),
    "recompute-none": (1, "--tp 1"),
    "recompute-selective": (1, "--tp 1 --recompute selective"),
    "recompute-full": (1, "--tp 1 --recompute full"),
    "tp2-sp": (2, "--tp 2 --sequence-parallel"),
    "pp2-1f1b": (2, "--tp 1 --pp 2 --micro-batches 4 --schedule 1f1b"),
    "pp2-zb-h1": (2, "--tp 1 --pp 2 --micro-batches 4 --schedule zb-h1"),
    "pp2-zb-v": (2, "--tp 1 --pp 2 --micro-batches 4 --schedule zb-v --virtual-stages 2"),
    "pp2-zb-h1-full": (2, "--tp 1 --pp 2 --micro-batches 4 --schedule zb-h1 --recompute full"),
}


def estimate(r: dict) -> dict:
    """The planner's memory per rank for the run's layout (mpi-tp plan's memory_per_rank)."""
    from mpi_tp.planning.costmodel import Plan, Workload
    from mpi_tp.planning.machines import Machine, with_precision
    from mpi_tp.planning.memory import memory_per_rank
    s, pp = r["shape"], r.get("pp", 1)
    M = r.get("micro_batches", 1) if pp > 1 else 1
    m = with_precision(Machine.load(MACHINE), r.get("precision", "fp32"))
    w = Workload(s["n_layer"], s["n_embd"], s["n_head"], s["block_size"], s["batch"] * r["dp"] * M, vocab=256)
    schedule = r.get("schedule") if r.get("schedule") in ("zb-h1", "zb-v") else None
    lay = Plan(tp=r["tp"], pp=pp, dp=r["dp"], micro_batch=s["batch"], sp=r["sequence_parallel"],
               zero=int(r.get("zero") or 0), recompute=r.get("recompute", "none"), schedule=schedule,
               virtual=r.get("virtual_stages", 1) if pp > 1 else 1)
    return {k: float(v) for k, v in memory_per_rank(m, w, lay).items()}


def run(name: str) -> dict | None:
    ranks, options = LAYOUTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.jsonl")
        cmd = (["mpiexec", "-n", str(ranks)] if ranks > 1 else []) + \
            [sys.executable, "-m", "mpi_tp", "bench", "--custom", SHAPE, "--steps", "1", "--warmup", "0",
             "--json", path] + options.split()
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{name}: not run ({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'failed'})")
            return None
        with open(path) as f:
            r = json.loads(f.readline())
    est = estimate(r)
    peak = r["memory_measured"]["peak"]
    from mpi_tp.core.runtime import machine_text
    return {"layout": name, "ranks": ranks, "shape": r["shape"], "tp": r["tp"], "pp": r.get("pp", 1), "dp": r["dp"],
            "schedule": r.get("schedule"), "virtual_stages": r.get("virtual_stages", 1),
            "zero": r.get("zero", 0), "recompute": r.get("recompute", "none"), "precision": r.get("precision", "fp32"),
            "measured": r["memory_measured"], "estimate": est, "error": est["total"] / peak["total"] - 1,
            "machine": machine_text(), "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(
                ["mpiexec", "-n", str(ranks)] * (ranks > 1) + ["python -m mpi_tp bench --custom", SHAPE,
                                                              "--steps 1 --warmup 0 --json F", options])}


def table(rows: list) -> str:
    mib = (lambda b: f"{b / 2**20:.2f}")
    out = [("| layout | peak at | parameters | gradients | optimizer (+ scratch) | activations (+ messages) | "
            "measured peak | estimate: parameters, gradients, optimizer, activations + logits | estimate | error |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, e = r["measured"]["peak"], r["estimate"]
        out.append(f"| {r['layout']} | {r['measured']['peak_at']} (rank {r['measured']['rank']}) | "
                   f"{mib(p['parameters'])} | {mib(p['gradients'])} | {mib(p['optimizer'])} (+{mib(p['workspace'])}) | "
                   f"{mib(p['activations'])} (+{mib(p['communication'])}) | {mib(p['total'])} | "
                   f"{mib(e['parameters'])}, {mib(e['gradients'])}, {mib(e['optimizer'])}, "
                   f"{mib(e['activations'])} + {mib(e['logits'])} | {mib(e['total'])} | {100 * r['error']:+.1f}% |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated layouts (default: all)")
    ap.add_argument("--table", action="store_true", help="print the table from the JSON lines, run nothing")
    args = ap.parse_args()
    rows = []
    if os.path.exists(OUT):
        with open(OUT) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    if not args.table:
        names = args.only.split(",") if args.only else list(LAYOUTS)
        unknown = [n for n in names if n not in LAYOUTS]
        if unknown:
            sys.exit(f"unknown layouts {unknown}: choose from {', '.join(LAYOUTS)}")
        for name in names:
            row = run(name)
            if row is not None:
                rows = [r for r in rows if r["layout"] != name] + [row]
                print(f"{name}: measured {row['measured']['peak']['total'] / 2**20:.2f} MiB, estimate "
                      f"{row['estimate']['total'] / 2**20:.2f} MiB ({100 * row['error']:+.1f}%)", flush=True)
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        order = list(LAYOUTS)
        rows.sort(key=lambda r: order.index(r["layout"]))
        with open(OUT, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))


if __name__ == "__main__":
    main()
