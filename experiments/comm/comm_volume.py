"""Measured tensor-parallel communication per training step against the closed form.

    mpiexec -n 2 python -m mpi4py experiments/comm/comm_volume.py            # a few shapes, table on rank 0
    mpiexec -n 4 python -m mpi4py experiments/comm/comm_volume.py --json     # one JSON line per shape

For each shape the script runs one forward, backward and clipping step and
reads the collective counters. The closed form (docs/tensor_parallelism.md) is
(4L + 2) * B*S*C + 3*B*S elements in all-reduces plus one float64 scalar; the
volume follows the activations, so the hidden size enters once (C), and the MLP
width and the number of heads not at all.
"""
import argparse
import json

import numpy as np
from mpi4py import MPI

from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import clip_grad_norm

SHAPES = [  # (layers, hidden, heads, seq, batch)
    (2, 64, 4, 32, 4),
    (4, 128, 4, 64, 8),
    (4, 256, 8, 64, 8),
    (2, 512, 8, 128, 4),
]


def measure(topo, L, C, H, S, B, dtype="float32"):
    model = GPT(GPTConfig(block_size=S, n_layer=L, n_head=H, n_embd=C), topo, dtype=dtype)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (B, S)), rng.integers(0, 256, (B, S))
    topo.stats.reset()
    model.forward(x, y)
    model.backward()
    clip_grad_norm(model.parameters(), topo.tp, 1.0)
    snap = topo.stats.snapshot().get("tp/all_reduce", {"calls": 0, "bytes": 0, "seconds": 0.0})
    item = np.dtype(dtype).itemsize
    expected = ((4 * L + 2) * B * S * C + 3 * B * S) * item + 8 if topo.tp.size > 1 else 0
    return {"tp": topo.tp.size, "layers": L, "hidden": C, "heads": H, "seq": S, "batch": B,
            "all_reduces": snap["calls"], "bytes": snap["bytes"], "expected_bytes": expected,
            "seconds": snap["seconds"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON line per shape instead of a table")
    args = ap.parse_args()
    topo = Topology.create(MPI.COMM_WORLD)
    rows = [measure(topo, *shape) for shape in SHAPES if shape[2] >= topo.tp.size]
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{'tp':>3} {'L':>3} {'C':>5} {'S':>4} {'B':>3} {'calls':>6} {'measured B':>12} {'formula B':>12} {'ms':>8}")
    for r in rows:
        print(f"{r['tp']:>3} {r['layers']:>3} {r['hidden']:>5} {r['seq']:>4} {r['batch']:>3} {r['all_reduces']:>6} "
              f"{r['bytes']:>12,} {r['expected_bytes']:>12,} {1e3 * r['seconds']:>8.2f}")


if __name__ == "__main__":
    main()
