"""Cached decoding at fp32, bf16 and fp16: time per decode step, tokens per second and the KV cache's bytes.

    mpiexec -n 1 python -m mpi4py experiments/inference/decode_precision.py      # T = 1
    mpiexec -n 2 python -m mpi4py experiments/inference/decode_precision.py      # T = 2

At shape c of `mpi-tp bench` (C 1024, 16 heads, 2 blocks, S 128, 256 bytes of vocabulary), for each batch
(--batch, default 1 and 4): a prefill of 64 bytes per row (not timed), then --steps Decoder.step calls; a
round's time per step is the slowest rank's mean, the formats are visited in the opposite order each round
(a shared machine's drift falls on all alike) and the median over --rounds is printed. The weights are the
same master weights (seed 0) rounded once to each format. On a CPU bf16 and fp16 are for memory (half the
weights' and the KV cache's bytes), not speed: NumPy has no 16-bit GEMM, so every product widens its 16-bit
operands to fp32 first (mpi_tp.core.kernels_half). One JSON line per (format, batch) is appended to
experiments/inference/results/decode_precision.jsonl with the machine and the 1-minute load average.
"""
import argparse
import json
import os
import statistics
import time

import numpy
from mpi4py import MPI

from mpi_tp.core.blas import which
from mpi_tp.inference.decode import Decoder
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

HERE = os.path.dirname(os.path.abspath(__file__))
FORMATS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CFG = GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=16, n_embd=1024)     # bench's shape c


def time_steps(dec, batch, steps, comm) -> float:
    """Seconds per step (the slowest rank's mean) after a fresh 64-byte prefill of `batch` rows."""
    rng = numpy.random.default_rng(0)
    dec.prefill([list(rng.integers(0, 256, 64)) for _ in range(batch)])
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        dec.step(rng.integers(0, 256, batch))
    return comm.allreduce((time.perf_counter() - t0) / steps, op=MPI.MAX)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    topo = Topology.create(comm, tp=comm.Get_size())
    decoders = {f: Decoder(GPT(CFG, topo, dtype=d, seed=0).eval(), max(args.batch)) for f, d in FORMATS.items()}
    times = {(f, b): [] for f in FORMATS for b in args.batch}
    for r in range(args.rounds):
        order = list(FORMATS) if r % 2 == 0 else list(reversed(FORMATS))
        for f in order:
            for b in args.batch:
                times[f, b].append(time_steps(decoders[f], b, args.steps, comm))
    if comm.Get_rank() != 0:
        return
    machine = {"cpu": _cpu(), "cores": os.cpu_count(), "blas": which(), "numpy": numpy.__version__,
               "mpi": MPI.Get_library_version().split("\n")[0].strip(), "load_1min": os.getloadavg()[0],
               "date": time.strftime("%Y-%m-%d %H:%M")}
    print(f"T={comm.Get_size()}, shape c, prompt 64, {args.steps} steps, median of {args.rounds} rounds ({machine['cpu']})")
    print(f"{'format':>6} {'batch':>5} {'ms/step':>8} {'tok/s':>7} {'KV cache MiB/rank':>18} {'weights MiB/rank':>17}")
    lines = []
    for (f, b), ts in times.items():
        dec = decoders[f]
        ms = 1e3 * statistics.median(ts)
        row = {"format": f, "T": comm.Get_size(), "batch": b, "ms_per_step": ms, "tokens_per_s": 1e3 * b / ms,
               "kv_cache_mib_per_rank": dec.cache.nbytes / 2**20,
               "weights_mib_per_rank": sum(q.data.nbytes for q in dec.model.parameters()) / 2**20,
               "rounds_ms": [1e3 * t for t in ts], **machine}
        lines.append(row)
        print(f"{f:>6} {b:>5} {ms:>8.2f} {row['tokens_per_s']:>7.0f} {row['kv_cache_mib_per_rank']:>18.2f} "
              f"{row['weights_mib_per_rank']:>17.2f}")
    with open(os.path.join(HERE, "results", "decode_precision.jsonl"), "a") as out:
        out.writelines(json.dumps(row) + "\n" for row in lines)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    main()
