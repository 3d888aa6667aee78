"""Does overlapping sequence parallelism's backward collectives with the GEMMs pay on this machine?

    mpiexec -n 2 python -m mpi4py experiments/comm/sp_overlap.py --rounds 5

A column-parallel layer under sequence parallelism keeps its input's shard and gathers it again in the
backward pass. With SequenceSplit.overlap (MPI_TP_SP_OVERLAP=1) the all-gather starts before dX's GEMM
and is waited before dA's, and dX's reduce-scatter starts before dA's GEMM (Megatron's order); without
it (the default) the same collectives run one after the other. This times training steps of shape a (C 256, H 4, L 4, S 128,
B 8, float32, T = the ranks) both ways, alternating, and prints the medians of the backward pass and of
the step (the slowest rank's), with the raw times in experiments/comm/results/sp_overlap.jsonl.
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

from mpi_tp.core.runtime import machine_text
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.finalize import finalize_grads
from mpi_tp.parallel.topology import Topology

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and mode")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    topo = Topology.create(comm)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=128), topo, sequence_parallel=True)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (8, 128)), rng.integers(0, 256, (8, 128))
    times = {True: {"backward": [], "step": []}, False: {"backward": [], "step": []}}
    for k in range(args.rounds + 1):                   # round 0: warm-up, not kept
        for overlap in ((True, False) if k % 2 else (False, True)):
            model.sp_overlap = overlap                 # its passes' SequenceSplit.overlap
            for _ in range(args.steps):
                model.zero_grad()
                comm.Barrier()
                t0 = time.perf_counter()
                model.forward(x, y)
                t1 = time.perf_counter()
                model.backward()
                finalize_grads(model)
                t2 = time.perf_counter()
                if k:
                    times[overlap]["backward"].append(comm.allreduce(t2 - t1, op=MPI.MAX))
                    times[overlap]["step"].append(comm.allreduce(t2 - t0, op=MPI.MAX))
    if comm.Get_rank():
        return
    med = {o: {k: 1e3 * statistics.median(v) for k, v in times[o].items()} for o in times}
    print(f"{machine_text()}, T = {comm.Get_size()}, load {os.getloadavg()[0]:.1f}")
    for o in (True, False):
        print(f"overlap {'on ' if o else 'off'}: backward {med[o]['backward']:.1f} ms, forward + backward "
              f"{med[o]['step']:.1f} ms (median of {len(times[o]['step'])})")
    print(f"on / off: backward {med[True]['backward'] / med[False]['backward']:.3f}, "
          f"step {med[True]['step'] / med[False]['step']:.3f}")
    with open(os.path.join(HERE, "results", "sp_overlap.jsonl"), "w") as f:
        f.write(json.dumps({"machine": machine_text(), "date": time.strftime("%Y-%m-%d %H:%M"),
                            "ranks": comm.Get_size(), "times_s": {str(o): times[o] for o in times},
                            "median_ms": {str(o): med[o] for o in med}}) + "\n")


if __name__ == "__main__":
    main()
