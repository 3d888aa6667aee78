"""Activation memory per transformer layer, measured term by term against Korthikanti et al. (2022), Table 2.

    mpiexec -n 4 python -m mpi4py experiments/memory/activation_memory.py --out experiments/memory/results
    python experiments/memory/activation_memory.py --replot experiments/memory/results/activation_memory.jsonl

For each shape (S, B, C, H), T = 1, 2 and 4 (a layout of T x 4/T ranks: the replicas compute the
same), plain tensor parallelism and sequence parallelism, dropout 0 and 0.1, and no, selective and
full recomputation, the script runs one forward pass of a 2-block float32 model and reads off what
the first block's caches keep (mpi_tp.planning.activations.measured_terms, the largest over the
ranks), next to the same terms counted by the adapted formula (float32 values, 1-byte masks,
activation_terms) and by the paper's (16-bit values, dropout on). Writes activation_memory.jsonl
(one line per case, every term), prints the table of docs/parallelism.md#activation-memory, and
draws docs/figures/activation_memory.png (shape a, the terms stacked, stamped with the machine and
this command).
"""
import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpi_tp.core.runtime import machine_text
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.planning.activations import TERMS, activation_terms, measured_terms

SHAPES = {"a": (128, 8, 256, 4), "long": (512, 2, 256, 8), "wide": (128, 4, 1024, 16)}   # (S, B, C, H)
COMMAND = "mpiexec -n 4 python -m mpi4py experiments/memory/activation_memory.py"


def measure(comm, S, B, C, H, T, sp, p, recompute) -> dict:
    topo = Topology.create(comm, tp=T, dp=comm.Get_size() // T)
    cfg = GPTConfig(vocab_size=256, block_size=S, n_layer=2, n_head=H, n_embd=C, dropout=p)
    model = GPT(cfg, topo, dtype="float32", sequence_parallel=sp, recompute=recompute)
    x = np.random.default_rng(0).integers(0, 256, (B, S))
    model.forward(x, x)
    mine = measured_terms(model.h[0])
    names = sorted(set().union(*comm.allgather(list(mine))))
    got = {n: comm.allreduce(mine.get(n, 0), op=MPI.MAX) for n in names}     # the rank keeping the most
    total = comm.allreduce(model.h[0].activation_bytes(), op=MPI.MAX)
    topo.free()
    return {"S": S, "B": B, "C": C, "H": H, "T": T, "sp": sp, "dropout": p, "recompute": recompute,
            "measured": got, "measured_total": total,
            "formula": activation_terms(S, B, C, H, T, sp, p > 0, recompute),
            "paper": activation_terms(S, B, C, H, T, sp, True, recompute, paper=True)}


def table(rows) -> str:
    lines = ["| shape (S, B, C, H) | T | SP | dropout | recompute | measured MiB | formula MiB | worst term off "
             "| paper (16-bit) MiB | vs T = 1 | SP vs TP |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    key = lambda r: (r["S"], r["B"], r["C"], r["H"], r["dropout"], r["recompute"])
    one = {key(r): r["measured_total"] for r in rows if r["T"] == 1}
    plain = {key(r) + (r["T"],): r["measured_total"] for r in rows if not r["sp"]}
    for r in rows:
        f = sum(r["formula"].values())
        off = max(abs(r["measured"].get(n, 0) - v) / v for n, v in r["formula"].items())
        vs_tp = f"{r['measured_total'] / plain[key(r) + (r['T'],)]:.3f}" if r["sp"] else ""
        lines.append(f"| ({r['S']}, {r['B']}, {r['C']}, {r['H']}) | {r['T']} | {'yes' if r['sp'] else 'no'} | "
                     f"{r['dropout']} | {r['recompute']} | {r['measured_total'] / 2**20:.3f} | {f / 2**20:.3f} | "
                     f"{100 * off:.2f}% | {sum(r['paper'].values()) / 2**20:.3f} | "
                     f"{r['measured_total'] / one[key(r)]:.3f} | {vs_tp} |")
    return "\n".join(lines)


def plot(rows, path, stamp):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    S, B, C, H = SHAPES["a"]
    picked = [r for r in rows if (r["S"], r["B"], r["C"], r["H"]) == (S, B, C, H) and r["recompute"] == "none"
              and r["dropout"] == 0.1]
    picked.sort(key=lambda r: (r["T"], r["sp"]))
    names = [t.name for t in TERMS if any(t.name in r["measured"] for r in picked)]
    fig, ax = plt.subplots(figsize=(9, 5.2))
    labels = [f"T = {r['T']}" + (" + SP" if r["sp"] else "") for r in picked]
    bottom = np.zeros(len(picked))
    colors = plt.get_cmap("tab20")(np.linspace(0, 1, len(names)))
    for name, color in zip(names, colors):
        v = np.array([r["measured"].get(name, 0) / 2**20 for r in picked])
        ax.bar(labels, v, bottom=bottom, label=name, color=color, edgecolor="white", linewidth=0.5)
        bottom += v
    for i, r in enumerate(picked):
        ax.text(i, bottom[i] + 0.2, f"{bottom[i]:.2f} MiB\n(paper, 16-bit: {sum(r['paper'].values()) / 2**20:.2f})",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, bottom.max() * 1.25)
    ax.set_ylabel("activation MiB per layer (largest rank)")
    ax.set_title(f"One layer's activations kept for the backward pass, by term: S {S}, B {B}, C {C}, H {H}, "
                 "float32, dropout 0.1", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.text(0.01, 0.01, f"{stamp}; {COMMAND}", fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="experiments/memory/results", help="folder for activation_memory.jsonl")
    ap.add_argument("--figure", default="docs/figures/activation_memory.png")
    ap.add_argument("--replot", metavar="JSONL", help="draw the figure and print the table from earlier raw data")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            lines = [json.loads(line) for line in f]
        head, rows = lines[0], lines[1:]
        print(table(rows))
        plot(rows, args.figure, head["stamp"])
        return
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 4:
        sys.exit("run with 4 ranks (T = 1, 2 and 4 as layouts of them): " + COMMAND)
    rows = []
    for S, B, C, H in SHAPES.values():
        for T in (1, 2, 4):
            for sp in ((False, True) if T > 1 else (False,)):
                for p in (0.0, 0.1):
                    for recompute in ("none", "selective", "full"):
                        rows.append(measure(comm, S, B, C, H, T, sp, p, recompute))
    if comm.Get_rank():
        return
    stamp = f"{machine_text()}, {time.strftime('%Y-%m-%d')}"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "activation_memory.jsonl"), "w") as f:
        f.write(json.dumps({"stamp": stamp, "command": COMMAND}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(table(rows))
    plot(rows, args.figure, stamp)


if __name__ == "__main__":
    main()
