#!/usr/bin/env bash
# Regenerates the benchmark results that docs/performance.md quotes, from the current code:
#
#   bash experiments/bench/bench_results.sh            (from the repository root, mpi_tp installed, a quiet machine)
#
#   experiments/bench/results/bench_t1.txt, .jsonl   mpi-tp bench, shapes a b c, T = 1
#   experiments/bench/results/bench_t2.txt, .jsonl   the same under mpiexec -n 2 (T = 2)
#   experiments/bench/results/sweep_t1.jsonl         mpi-tp bench --sweep (hidden size x sequence length), T = 1
#   experiments/bench/results/malloc.jsonl           shapes a and c at T = 1, three times each way, alternating:
#                                                    glibc's defaults (MPI_TP_MALLOC=system), and freed memory
#                                                    kept (what mpi-tp bench and train do unless told otherwise)
# About 5 minutes on the 2-core build machine. One BLAS thread per rank; every figure is a median of
# the timed steps, and each line records the machine, BLAS, MPI and malloc settings it ran with.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=experiments/bench/results
export OMP_NUM_THREADS=1
rm -f "$R"/bench_t1.jsonl "$R"/bench_t2.jsonl "$R"/sweep_t1.jsonl "$R"/malloc.jsonl
mpi-tp bench --steps 10 --json "$R"/bench_t1.jsonl | tee "$R"/bench_t1.txt
mpiexec -n 2 mpi-tp bench --steps 10 --json "$R"/bench_t2.jsonl | tee "$R"/bench_t2.txt
mpi-tp bench --sweep --steps 3 --json "$R"/sweep_t1.jsonl
for _ in 1 2 3; do
  MPI_TP_MALLOC=system mpi-tp bench --shape a --shape c --steps 10 --json "$R"/malloc.jsonl
  mpi-tp bench --shape a --shape c --steps 10 --json "$R"/malloc.jsonl
done
python - "$R"/malloc.jsonl <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for C in sorted({r["shape"]["n_embd"] for r in rows}):
    med = {k: statistics.median(r["step_ms"]["median"] for r in rows
                                if r["shape"]["n_embd"] == C and bool(r["environment"]["malloc"]) == k)
           for k in (False, True)}
    print(f"C={C}: glibc defaults {med[False]:.1f} ms, freed memory kept {med[True]:.1f} ms "
          f"({100 * (1 - med[True] / med[False]):+.1f}% faster)")
EOF
