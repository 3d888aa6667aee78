"""A picture of pipeline schedules from a real run: each stage's forwards and backwards on its own clock.

    mpiexec -n 2 python -m mpi4py experiments/pipeline/pipeline_timeline.py         # docs/figures/pipeline_*.png
    mpiexec -n 4 python -m mpi4py experiments/pipeline/pipeline_timeline.py --micro-batches 8 --out /tmp/figs

Every rank is one stage of a GPT (float32, C 256, 4 heads, 2 blocks per stage,
S 128, one sequence per micro-batch). For GPipe, 1F1B, ZB-H1 and ZB-V (two
chunks of one block per stage, in a V) it runs one training step to warm up and
one traced step (mpi_tp.parallel.trace), then rank 0 draws the traced forward,
backward and W actions of every stage as boxes on a common time axis, with the
measured bubble and the formula at equal F, B and W times
(commands.explain.pipeline.ideal_formula), stamped with the machine and the command. The raw trace of each picture is written beside
it (experiments/pipeline/results/pipeline_<schedule>_P<p>_M<m>.trace.json, Chrome trace
format). Needs matplotlib (the `experiments` extra).
"""
import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    raise SystemExit("experiments/pipeline/pipeline_timeline.py needs matplotlib: pip install matplotlib") from None

from mpi_tp.commands.explain.pipeline import FORMULA, ideal_formula
from mpi_tp.core.runtime import machine_text
from mpi_tp.model.chunks import build_stage
from mpi_tp.model.config import GPTConfig
from mpi_tp.parallel.topology import Topology
from mpi_tp.parallel.trace import Trace
from mpi_tp.training.step import forward_backward

HERE = os.path.dirname(os.path.abspath(__file__))
COLORS = plt.get_cmap("tab10").colors


SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-v", 2))        # (name, chunks per stage)
SHADE = {"F": 1.0, "B": 0.55, "W": 0.25}


def traced_step(comm, name, M, v):
    P = comm.Get_size()
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=2 * P, n_head=4, n_embd=256)
    topo = Topology.create(comm, tp=1, pp=P, dp=1)
    stage = build_stage(cfg, topo, "float32", 0, False, name, M, v)
    x = np.random.default_rng(0).integers(0, 256, (M, 128))
    y = np.roll(x, -1, axis=1)
    forward_backward(stage, x, y, slice(0, M))                  # warm-up
    topo.stats.trace = trace = Trace(comm)
    forward_backward(stage, x, y, slice(0, M))
    topo.stats.trace = None
    everyone = comm.gather(trace.events, root=0)
    topo.free()
    return everyone


def draw(everyone, name, P, M, v, path, command):
    acts = [[e for e in ev if e["name"] in SHADE] for ev in everyone]
    t0 = min(e["ts"] for ev in acts for e in ev)
    end = max(e["ts"] + e["dur"] for ev in acts for e in ev)
    busy = max(sum(e["dur"] for e in ev) for ev in acts)
    bubble = (end - t0 - busy) / busy
    fig, ax = plt.subplots(figsize=(10, 0.6 * P + 1.6))
    for s, ev in enumerate(acts):
        for e in ev:
            m = e["args"]["micro"]
            face = COLORS[m % len(COLORS)]
            ax.barh(P - 1 - s, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=0.8, color=face,
                    alpha=SHADE[e["name"]], edgecolor="black", linewidth=0.4)
            ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, P - 1 - s, f"{e['name']}{m}", ha="center", va="center",
                    fontsize=7)
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"stage {s}" for s in reversed(range(P))])
    ax.set_xlabel("milliseconds since the step began (each stage's own clock, aligned by a barrier)")
    ax.set_title(f"{name}: P = {P} stages, M = {M} micro-batches; bubble measured {bubble:.2f}, "
                 f"formula {FORMULA[name]} = {ideal_formula(name, P, M, v):.2f}   (F: forward, B: backward, "
                 f"lighter, W: weights' gradients, lightest)", fontsize=9)
    fig.text(0.01, 0.01, f"{machine_text()}, {time.strftime('%Y-%m-%d')}; {command}",
             fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return bubble


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(HERE, "..", "..", "docs", "figures"))
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    comm, M = MPI.COMM_WORLD, args.micro_batches
    P = comm.Get_size()
    command = f"mpiexec -n {P} python -m mpi4py experiments/pipeline/pipeline_timeline.py --micro-batches {M}"
    for name, v in SCHEDULES:
        everyone = traced_step(comm, name, M, v)
        if comm.Get_rank() == 0:
            stem = f"pipeline_{name}_P{P}_M{M}"
            with open(os.path.join(args.results, stem + ".trace.json"), "w") as f:
                json.dump({"traceEvents": [e for ev in everyone for e in ev], "command": command}, f)
            png = os.path.join(args.out, stem + ".png")
            bubble = draw(everyone, name, P, M, v, png, command)
            print(f"wrote {png} (bubble measured {bubble:.2f}, formula {ideal_formula(name, P, M, v):.2f})")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
