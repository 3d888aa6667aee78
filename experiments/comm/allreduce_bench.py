"""Flat against hierarchical all-reduce, over the whole world, at several message sizes.

    srun -N 2 -n 4 --mpi=pmi2 python experiments/comm/allreduce_bench.py        # real nodes
    MPI_TP_FAKE_NODES=2 mpiexec -n 4 python -m mpi4py experiments/comm/allreduce_bench.py   # emulated

Each size: median of --repeats timed calls (after a warm-up), each preceded by a
barrier; the time is the slowest rank's. The hierarchical version (mpi_tp.parallel.hierarchical)
reduces inside each node, all-reduces among one rank per node, and broadcasts back.
"""
import argparse
import json
import socket

import numpy as np
from mpi4py import MPI

from mpi_tp.core.mpi_library import library_version
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.comm_stats import CommStats
from mpi_tp.parallel.hierarchical import HierarchicalAllReduce


def timed(comm, fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        comm.Barrier()
        t = MPI.Wtime()
        fn()
        ts.append(comm.allreduce(MPI.Wtime() - t, op=MPI.MAX))
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    group = Group(comm, "world", CommStats())
    hier = HierarchicalAllReduce(group)
    hosts = sorted(set(comm.allgather(socket.gethostname())))
    rows = []
    for n_bytes in (2**10, 2**14, 2**18, 2**20, 2**22, 2**24, 2**26):
        x = np.ones(n_bytes // 4, dtype=np.float32)
        flat = timed(comm, lambda: comm.Allreduce(MPI.IN_PLACE, x), args.repeats)
        h = timed(comm, lambda: hier.all_reduce(x), args.repeats)
        rows.append({"bytes": n_bytes, "flat_ms": 1e3 * flat, "hierarchical_ms": 1e3 * h, "ranks": comm.Get_size(),
                     "nodes": hier.nodes, "hosts": hosts})
    if comm.Get_rank():
        return
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{comm.Get_size()} ranks on {hier.nodes} node(s) {hosts}; {library_version()}")
    print("| message | flat ms | hierarchical ms | hierarchical / flat |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['bytes'] / 2**20:.3g} MB | {r['flat_ms']:.3f} | {r['hierarchical_ms']:.3f} | "
              f"{r['hierarchical_ms'] / r['flat_ms']:.2f} |")


if __name__ == "__main__":
    main()
