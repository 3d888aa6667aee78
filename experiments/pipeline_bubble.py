"""The pipeline bubble against the number of micro-batches, measured from traced steps, beside the formula.

    mpiexec -n 2 python -m mpi4py experiments/pipeline_bubble.py      # P = 2: results/pipeline_bubble.jsonl + plot

For M = 1, 2, 4, 8, 16 micro-batches of one sequence (C 256, 4 heads, 4 blocks,
S 128, float32) and the schedules GPipe, 1F1B and interleaved (2 chunks per
stage, M a multiple of P), runs `mpi-tp bench --pp`'s measurement
(commands.bench_pipeline.run_pipeline_shape: 3 timed steps after 1 warm-up,
the median bubble) and draws measured against (P - 1) / (V M), stamped with the
machine and the command. Needs matplotlib (the `experiments` extra).
"""
import json
import os
import time

from mpi4py import MPI

from mpi_tp.commands.bench import environment
from mpi_tp.commands.bench_pipeline import run_pipeline_shape

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "pipeline_bubble.jsonl")
FIGURE = os.path.join(HERE, "..", "docs", "figures", "pipeline_bubble.png")


def main():
    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    rows = []
    for name, V in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for M in (1, 2, 4, 8, 16):
            if name == "interleaved" and M % P:
                continue
            r = run_pipeline_shape(comm, 256, 4, 4, 128, 1, 3, 1, "float32", 1, P, 1, M, name, V)
            r["environment"] = environment(comm)
            rows.append(r)
            if comm.Get_rank() == 0:
                print(f"{name} M={M}: bubble {r['bubble']['measured']:.3f} (formula {r['bubble']['formula']:.3f}), "
                      f"step {r['step_ms']['median']:.0f} ms", flush=True)
    if comm.Get_rank():
        return
    with open(RESULTS, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, color) in (("gpipe", "C0"), ("1f1b", "C1"), ("interleaved", "C2")):
        mine = [r for r in rows if r["schedule"] == name]
        Ms = [r["micro_batches"] for r in mine]
        ax.plot(Ms, [r["bubble"]["measured"] for r in mine], "o-", color=color, label=f"{name}, measured")
        ax.plot(Ms, [r["bubble"]["formula"] for r in mine], "--", color=color, alpha=0.6,
                label=f"{name}, " + ("(P - 1) / (V M)" if name == "interleaved" else "(P - 1) / M"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per step, M")
    ax.set_ylabel("bubble: idle time / busiest stage's work")
    ax.set_title(f"Pipeline bubble, P = {P} stages, C 256, 4 blocks, S 128, one sequence per micro-batch",
                 fontsize=9)
    ax.legend(fontsize=7)
    e = rows[0]["environment"]
    fig.text(0.01, 0.01, f"{e['cpu']}, {e['cores']} cores, {' '.join(e['mpi'].replace('Version:', '').split())}, "
             f"{time.strftime('%Y-%m-%d')}; mpiexec -n {P} python -m mpi4py experiments/pipeline_bubble.py",
             fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(FIGURE, dpi=110)
    print(f"wrote {RESULTS} and {FIGURE}")


if __name__ == "__main__":
    main()
