"""One training step, rank by rank, drawn from the run's own trace: its phases and every collective.

    mpiexec -n 2 python -m mpi4py experiments/comm/step_timeline.py        # docs/figures/step_timeline*.png

Runs `mpi-tp explain --layer step`'s step (mpi_tp.commands.explain.step.run_step:
the training code's build and train_step, checked against the serial step) at
two ranks, once to warm up and once traced (mpi_tp.parallel.trace), for plain
tensor parallelism (T = 2), sequence parallelism, data parallelism (D = 2), a
pipeline (P = 2) and an MoE block over two expert-parallel replicas. Rank 0 draws, for every rank, the
phases (embedding, blocks, loss, backward, gradient norm, optimizer) as one
lane and the collectives as another, coloured by kind and annotated with their
buffer bytes and wire bytes, on a common time axis, stamped with the machine
and the command. The raw events and the per-phase counters go to
experiments/comm/results/step_timeline*.json. Needs matplotlib (the `experiments` extra).
"""
import argparse
import json
import os
import sys
import time

from mpi4py import MPI

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    raise SystemExit("experiments/comm/step_timeline.py needs matplotlib: pip install matplotlib") from None

from mpi_tp.core.mpi_library import library_version
from mpi_tp.commands.explain import add_parser
from mpi_tp.commands.explain.common import wire_bytes
from mpi_tp.commands.explain.step import OUTSIDE, PHASES, plan, run_step
from mpi_tp.core.runtime import cpu_name, machine_text
from mpi_tp.parallel.trace import Trace

HERE = os.path.dirname(os.path.abspath(__file__))
GAP = 2.8                     # vertical room of one rank: its phases, its collectives, their labels
COMMAND = "mpiexec -n {W} python -m mpi4py experiments/comm/step_timeline.py"
SIZES = ["--features", "64", "--heads", "4", "--seq", "32", "--batch", "4"]
LAYOUTS = {"step_timeline": [], "step_timeline_sp": ["--sequence-parallel"],     # at W = 2: T = 2
           "step_timeline_dp": ["--dp", "2"], "step_timeline_pp": ["--pp", "2"],   # T = 1 x D = 2; P = 2 stages
           "step_timeline_moe": ["--moe-experts", "4", "--dp", "2", "--ep", "2"]}  # experts over 2 replicas
PHASE_COLORS = dict(zip(PHASES, plt.get_cmap("Pastel1").colors))
KIND_COLORS = {"all_reduce": "#d62728", "all_gather": "#1f77b4", "reduce_scatter": "#2ca02c",
               "sp_grad_all_reduce": "#ff7f0e", "iall_reduce": "#9467bd", "send": "#8c564b", "recv": "#c49c94",
               "broadcast": "#7f7f7f", "embedding_all_reduce": "#e377c2", "all_to_all": "#bcbd22",
               "all_to_allv": "#17becf"}


def traced(comm, options):
    """The step's configuration, every rank's trace events and result (rank 0), after a warm-up step."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    cfg = plan(parser.parse_args(["explain", "--layer", "step", *SIZES, *options]), comm.Get_size())
    run_step(cfg, comm)                                      # warm-up: imports, buffers, caches
    trace = Trace(comm)
    result = run_step(cfg, comm, trace)
    return cfg, comm.gather(trace.events, root=0), comm.gather(result, root=0)


def short(n: float) -> str:
    return f"{n / 1024:.3g}K" if n >= 1024 else f"{n:.0f}B"


def draw(events, results, cfg, path, command):
    W = len(events)
    t0 = min(e["ts"] for ev in events for e in ev if e["cat"] in ("phase", "comm"))
    span = (max(e["ts"] + e["dur"] for ev in events for e in ev if e["cat"] in ("phase", "comm")) - t0) / 1e3
    fig, ax = plt.subplots(figsize=(15, 1.8 * W + 1.8))
    for r, ev in enumerate(events):
        y = (W - 1 - r) * GAP
        for e in ev:
            if e["cat"] != "phase" or e["name"] == "stage to stage":   # it encloses a pipeline's whole schedule:
                continue                                                # its sends and receives show below
            left, width = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            ax.barh(y + 0.55, width, left=left, height=0.7, color=PHASE_COLORS[e["name"]], edgecolor="#555555",
                    linewidth=0.4)
            if width >= 0.05 * span:                  # a name only where it fits; the colours say the rest
                ax.text(left + width / 2, y + 0.55, e["name"], ha="center", va="center", fontsize=6.5, clip_on=True)
        comm_events = sorted((e for e in ev if e["cat"] == "comm"), key=lambda e: e["ts"])
        for k, e in enumerate(comm_events):
            group, kind = e["name"].split("/", 1)
            G = results[r]["sizes"][group]
            left, width = (e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.004)
            ax.barh(y - 0.35, width, left=left, height=0.6, color=KIND_COLORS.get(kind, "black"))
            n = e["args"]["bytes"]
            ax.text(left, y - 0.7 - 0.2 * (k % 4), f"{short(n)}/{short(wire_bytes(kind, n, G))}",
                    fontsize=5.5, va="top", color=KIND_COLORS.get(kind, "black"))
    ax.set_yticks([(W - 1 - r) * GAP + d for r in range(W) for d in (0.55, -0.35)])
    ax.set_yticklabels([f"rank {r} {lane}" for r in range(W) for lane in ("phases", "collectives")], fontsize=7)
    ax.set_ylim(-1.7, GAP * (W - 1) + 1.4)
    ax.set_xlabel("milliseconds since the step began (each rank's clock, aligned by a barrier)")
    ok = all(x["ok"] for x in results)
    layout = f"T = {cfg.tp}, D = {cfg.dp}" + (f", P = {cfg.pp} (1F1B, M = {cfg.micro_batches})" if cfg.pp > 1 else "")
    layout += ", sequence-parallel" if cfg.sequence_parallel else ""
    layout += f", block 1 MoE: E = {cfg.moe_experts}, ep = {cfg.ep}" if cfg.moe_experts else ""
    ax.set_title(f"one training step at {layout}: L = {cfg.n_layer}, C = {cfg.n_embd}, S = {cfg.block_size}, "
                 f"B = {cfg.batch_size}, float64; labels: buffer bytes/wire bytes (K = KiB); vs the serial step: "
                 f"{'PASS' if ok else 'FAIL'}", fontsize=8.5)
    seen = {e["name"].split("/", 1)[1] for ev in events for e in ev if e["cat"] == "comm"}
    seen |= {e["name"] for ev in events for e in ev if e["cat"] == "phase" and e["name"] != "stage to stage"}
    colours = {**{k: c for k, c in PHASE_COLORS.items() if k != "stage to stage"}, **KIND_COLORS}
    keep = [(plt.Rectangle((0, 0), 1, 1, color=c), k) for k, c in colours.items() if k in seen]
    ax.legend([h for h, _ in keep], [k for _, k in keep], fontsize=6, loc="upper left", bbox_to_anchor=(1.005, 1.0),
              frameon=False)
    fig.text(0.01, 0.01, f"{machine_text()}, {time.strftime('%Y-%m-%d')}; {command}",
             fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "..", "..", "docs", "figures"))
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    command = COMMAND.format(W=comm.Get_size())
    for stem, options in LAYOUTS.items():
        cfg, events, results = traced(comm, options)
        if comm.Get_rank() != 0:
            continue
        record = {"command": command, "options": SIZES + options, "machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                  "mpi": library_version()}, "date": time.strftime("%Y-%m-%d"),
                  "phase_outside_the_marked_ones": OUTSIDE,
                  "ranks": [{"result": r, "events": ev} for r, ev in zip(results, events)]}
        with open(os.path.join(args.results, stem + ".json"), "w") as f:
            json.dump(record, f, indent=1, default=float)
        png = os.path.join(args.out, stem + ".png")
        draw(events, results, cfg, png, command)
        print(f"wrote {png}: every rank equals the serial step: {all(r['ok'] for r in results)}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
