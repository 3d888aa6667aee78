"""The pipeline bubble against the number of micro-batches, measured from traced steps, beside the formula.

    mpiexec -n 2 python -m mpi4py experiments/pipeline/pipeline_bubble.py   # P = 2: results/pipeline_bubble.jsonl, plot
    mpiexec -n 4 python -m mpi4py experiments/pipeline/pipeline_bubble.py --n-layer 8 \
        --results experiments/pipeline/results/pipeline_bubble_P4.jsonl --figure docs/figures/pipeline_bubble_P4.png

For M = 1, 2, 4, 8, 16 micro-batches of one sequence (C 256, 4 heads, 4 blocks,
S 128, float32) and the schedules GPipe, 1F1B, interleaved (2 chunks per
stage, M a multiple of P), ZB-H1 and ZB-V (2 chunks per stage in a V), runs `mpi-tp bench --pp`'s measurement
(commands.bench.pipeline.run_pipeline_shape: 3 timed steps after 1 warm-up,
the median bubble: idle over compute time, of the busiest stage, as
docs/notation.md defines it) and draws measured against its formula (mpi_tp.planning.bubble;
the zero-bubble ones at the run's measured share w of W in the work), and, beside, each
schedule's median step time over 1F1B's at the same M, stamped with the machine and the command. With more ranks than cores the title and the stamp
say so ("4 ranks on 2 cores (oversubscribed)"): the stages then share cores,
which the formula does not know about. --n-layer 8 gives P = 4 two blocks per
stage (the interleaved schedule needs a block per chunk). Needs matplotlib (the
`experiments` extra); --replot redraws the figure from --results alone.
"""
import argparse
import json
import os
import sys
import textwrap

from mpi4py import MPI

from mpi_tp.commands.bench import environment
from mpi_tp.commands.bench.pipeline import run_pipeline_shape

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2))     # (name, chunks)
FORMULAS = {"gpipe": "(P - 1) / M", "1f1b": "(P - 1) / M", "interleaved": "(P - 1) / (v M)",
            "zb-h1": "(P - 1)(1 - 2w) / M", "zb-v": "(P - 1)(1 - 3w) / (2M)"}      # mpi_tp.planning.bubble
RESULTS = os.path.join(HERE, "results", "pipeline_bubble.jsonl")
FIGURE = os.path.join(HERE, "..", "..", "docs", "figures", "pipeline_bubble.png")


def plot(rows, figure, command):
    """Measured bubble against the formula per schedule, from the rows alone (their layout, machine, date)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    P, e, shape = rows[0]["pp"], rows[0]["environment"], rows[0]["shape"]
    crowded = rows[0].get("oversubscribed", "")
    fig, (ax, speed) = plt.subplots(1, 2, figsize=(11, 4.3), gridspec_kw={"width_ratios": [3, 2]})
    base = {r["micro_batches"]: r["step_ms"]["median"] for r in rows if r["schedule"] == "1f1b"}
    for (name, color) in zip(SCHEDULES, ("C0", "C1", "C2", "C3", "C4")):
        mine = [r for r in rows if r["schedule"] == name[0]]
        if not mine:
            continue
        Ms = [r["micro_batches"] for r in mine]
        ax.plot(Ms, [r["bubble"]["measured"] for r in mine], "o-", color=color, label=f"{name[0]}, measured")
        ax.plot(Ms, [r["bubble"]["formula"] for r in mine], "--", color=color, alpha=0.6,
                label=f"{name[0]}, {FORMULAS[name[0]]}")
        speed.plot(Ms, [r["step_ms"]["median"] / base[r["micro_batches"]] for r in mine], "o-", color=color,
                   label=name[0])
    speed.axhline(1.0, color="#999999", linewidth=0.6)
    speed.set_xscale("log", base=2)
    speed.set_xlabel("micro-batches per step, M")
    speed.set_ylabel("median step time / 1F1B's at the same M")
    speed.legend(fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per step, M")
    ax.set_ylabel("bubble: idle / compute time,\nof the busiest stage")     # docs/notation.md, Pipelines
    ax.set_title(f"Pipeline bubble, P = {P} stages, C {shape['n_embd']}, {shape['n_layer']} blocks, "
                 f"S {shape['block_size']}, one sequence per micro-batch" + (f"\n{crowded}" if crowded else ""),
                 fontsize=9)
    ax.legend(fontsize=7)
    command = textwrap.wrap(command, 150, break_on_hyphens=False)
    fig.text(0.01, 0.01, f"{e['cpu']}, {e['cores']} cores, {' '.join(e['mpi'].replace('Version:', '').split())}, "
             f"{e.get('date', '')}{'; ' + crowded if crowded else ''}\n" + "\n".join(command),
             fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.035 + 0.025 * len(command), 1, 1))
    fig.savefig(figure, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=4, help="transformer blocks (default 4)")
    ap.add_argument("--results", default=RESULTS,
                    help="JSON lines written here (default results/pipeline_bubble.jsonl)")
    ap.add_argument("--figure", default=FIGURE, help="the plot (default docs/figures/pipeline_bubble.png)")
    ap.add_argument("--replot", action="store_true", help="only redraw --figure from --results (no MPI run)")
    args = ap.parse_args()
    argv = " ".join(a for a in sys.argv[1:] if a != "--replot")
    if args.replot:
        with open(args.results) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        command = f"mpiexec -n {rows[0]['pp']} python -m mpi4py experiments/pipeline/pipeline_bubble.py {argv}".rstrip()
        plot(rows, args.figure, command + " (redrawn with --replot)")
        print(f"wrote {args.figure} from {args.results}")
        return
    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    cores = os.cpu_count()
    crowded = f"{P} ranks on {cores} cores (oversubscribed)" if P > cores else ""
    rows = []
    for name, v in SCHEDULES:
        for M in (1, 2, 4, 8, 16):
            if name == "interleaved" and M % P:
                continue
            load0 = os.getloadavg()
            r = run_pipeline_shape(comm, 256, 4, args.n_layer, 128, 1, 3, 1, "float32", 1, P, 1, M, name, v)
            r["environment"] = environment(comm)
            r["loadavg_start"], r["loadavg_end"] = list(load0), list(os.getloadavg())
            if crowded:
                r["oversubscribed"] = crowded
            rows.append(r)
            if comm.Get_rank() == 0:
                print(f"{name} M={M}: bubble {r['bubble']['measured']:.3f} (formula {r['bubble']['formula']:.3f}), "
                      f"step {r['step_ms']['median']:.0f} ms", flush=True)
    if comm.Get_rank():
        return
    with open(args.results, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    plot(rows, args.figure, f"mpiexec -n {P} python -m mpi4py experiments/pipeline/pipeline_bubble.py {argv}".rstrip())
    print(f"wrote {args.results} and {args.figure}")


if __name__ == "__main__":
    main()
