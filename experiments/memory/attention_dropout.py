"""Attention dropout's memory at long sequences: what the blocks keep and the peak a step reaches, with and
without dropout, on one rank (the online softmax, S >= ONLINE_FROM) and at cp 2 (ring attention).

    python experiments/memory/attention_dropout.py                         # cp 1
    mpiexec -n 2 python -m mpi4py experiments/memory/attention_dropout.py  # cp 2
    ... --label before   # the same run against an older checkout (PYTHONPATH=<its root>): its masks were whole

A GPT-2 of C 128, 4 heads, 1 block, vocabulary 256, batch 1, float32, at cp = the world size, for
S = 4096 and 8192 and dropout 0 and 0.1. One forward + backward under tracemalloc (NumPy reports its
arrays to it): `kept` is what the blocks hold after the forward (Block.activation_bytes: the largest rank),
`peak` the most bytes allocated at once during the step above what was allocated before it (the largest
rank), `formula` mpi_tp.planning.activations' count for this rank's S / cp positions (selective: the online
and ring caches keep the output and log-sum-exp, no probabilities), and `whole_mask` the H S^2 B / cp bytes
of one layer's (B, H, S/cp, S) bool mask, what the online path and ring attention drew and held at once
before the masks were drawn by tile (mpi_tp.model.dropout.TileMasks), and the step's seconds (the median of two
untraced steps, the slowest rank's). One JSON
line per case in experiments/memory/results/attention_dropout.jsonl, with the machine, the command and the label.
"""
import argparse
import json
import os
import time
import tracemalloc

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "attention_dropout.jsonl")
C, H, L, B = 128, 4, 1, 1
SIZES = (4096, 8192)


def step(model, x, comm):
    """(kept bytes after the forward, peak bytes over the step, seconds): the memory from one step under
    tracemalloc, the time the median of two steps without it (its bookkeeping slows NumPy's allocations)."""
    times = []
    for _ in range(2):
        comm.Barrier()
        t0 = time.perf_counter()
        model.zero_grad()
        model.forward(x[:, :-1], x[:, 1:])
        model.backward()
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    model.zero_grad()
    model.forward(x[:, :-1], x[:, 1:])
    kept = sum(b.activation_bytes() for b in model.h)
    model.backward()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return kept, peak, float(numpy.median(times))


def main():
    from mpi4py import MPI

    from mpi_tp.core.runtime import machine_text
    from mpi_tp.model.config import GPTConfig
    from mpi_tp.model.gpt import GPT
    from mpi_tp.parallel.topology import Topology
    from mpi_tp.planning.activations import activation_bytes_per_layer
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="now", help="what the run measures (default: now)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    N = comm.Get_size()
    topo = Topology.create(comm, tp=1, cp=N)
    for S in SIZES:
        for p in (0.0, 0.1):
            model = GPT(GPTConfig(vocab_size=256, block_size=S, n_layer=L, n_head=H, n_embd=C, dropout=p), topo, seed=0)
            x = numpy.random.default_rng(0).integers(0, 256, (B, S + 1))
            kept, peak, seconds = step(model, x, comm)
            row = {"label": args.label, "cp": N, "S": S, "dropout": p, "machine": machine_text(),
                   "command": (f"mpiexec -n {N} python -m mpi4py " if N > 1 else "python ")
                   + f"experiments/memory/attention_dropout.py --label {args.label}",
                   "kept_bytes": comm.allreduce(kept, op=MPI.MAX), "peak_bytes": comm.allreduce(peak, op=MPI.MAX),
                   "formula_bytes": L * activation_bytes_per_layer(S / N, B, C, H, 1, dropout=p > 0,
                                                                   recompute="selective"),
                   "whole_mask_bytes": H * S * S * B // N, "step_s": comm.allreduce(seconds, op=MPI.MAX)}
            if comm.Get_rank() == 0:
                os.makedirs(os.path.dirname(OUT), exist_ok=True)
                with open(OUT, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps({k: row[k] for k in row if k not in ("machine", "command")}), flush=True)
    topo.free()


if __name__ == "__main__":
    main()
