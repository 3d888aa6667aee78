"""Activation memory per transformer layer: measured against Korthikanti et al. (2022) and our own count.

    python -m mpi4py experiments/activation_memory.py                 # t = 1
    mpiexec -n 2 python -m mpi4py experiments/activation_memory.py    # t = 2, with and without SP

For each (s, b, h, a) the script runs one forward pass of a 2-layer float32
model (no dropout) and reads `Block.activation_bytes()` (the memory its
caches keep alive for the backward pass; the largest over the ranks), and the
growth of the process's peak resident memory over the forward pass. The
formulas:

  Korthikanti et al. (16-bit activations, 1-byte dropout masks), bytes per layer,
  in docs/notation.md's letters (its 'Translating the papers'):
      no parallelism  S B C (34 + 5 H S / C)
      TP              S B C (10 + 24/T + 5 H S / (C T))
      TP + SP         S B C (34 + 5 H S / C) / T
  mpi_tp (float32, no dropout), bytes per layer:
      TP              4 (S B C (4 + 16/T) + H S^2 B / T)
      TP + SP         4 (S B C (2 + 18/T) + H S^2 B / T)
  (kept, in units of S B C values: LayerNorm outputs 2, the two column layers' inputs 2,
  q/k/v 3, the attention output 1, GELU input and tanh 8, the MLP projection's input
  4; softmax probabilities H S^2 B; under SP the LayerNorm outputs are split but
  the column layers keep their all-gathered input, see docs/parallelism.md.)
"""
import argparse
import json
import os

import numpy as np
from mpi4py import MPI

from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

CONFIGS = [(64, 4, 128, 4), (128, 4, 256, 4), (128, 8, 256, 8), (256, 4, 512, 8)]   # (s, b, h, a)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def korthikanti(s, b, h, a, t, sp):
    if t == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if sp:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def ours(s, b, h, a, t, sp):
    replicated, split = (2, 18) if sp and t > 1 else (4, 16)
    return 4 * (s * b * h * (replicated + split / t) + a * s * s * b / t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    t = comm.Get_size()
    rows = []
    for s, b, h, a in CONFIGS:
        for sp in ([False, True] if t > 1 else [False]):
            topo = Topology.create(comm)
            model = GPT(GPTConfig(vocab_size=256, block_size=s, n_layer=2, n_head=a, n_embd=h), topo,
                        dtype="float32", sequence_parallel=sp)
            x = np.random.default_rng(0).integers(0, 256, (b, s))
            rss0 = resident_bytes()
            model.forward(x, x)
            growth = comm.allreduce(resident_bytes() - rss0, op=MPI.MAX)
            measured = comm.allreduce(model.h[0].activation_bytes(), op=MPI.MAX)
            model.backward()
            rows.append({"s": s, "b": b, "h": h, "a": a, "t": t, "sp": sp, "measured_bytes": measured,
                         "ours_formula": ours(s, b, h, a, t, sp), "korthikanti_16bit": korthikanti(s, b, h, a, t, sp),
                         "rss_growth_forward": growth})
    if comm.Get_rank():
        return
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print("| s | b | h | a | t | SP | measured MB/layer | our formula | Korthikanti (16-bit) | RSS growth over the forward (whole model) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['s']} | {r['b']} | {r['h']} | {r['a']} | {r['t']} | {'yes' if r['sp'] else 'no'} | "
              f"{r['measured_bytes'] / 2**20:.2f} | {r['ours_formula'] / 2**20:.2f} | "
              f"{r['korthikanti_16bit'] / 2**20:.2f} | {r['rss_growth_forward'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
