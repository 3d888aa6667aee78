#!/usr/bin/env bash
# The GPU checks, in a few minutes, on any machine with one (or more) NVIDIA GPUs:
#
#   bash experiments/gpu_check.sh            (from the repository root, mpi_tp installed with the gpu extra)
#
# 1. CuPy sees a GPU; what MPI says about CUDA support.
# 2. tests/test_gpu.py under mpiexec -n 1, 2 and 4 (ranks share the GPU): the model on the GPU equals
#    the NumPy model (losses and weights, float64, sequence parallelism on), collectives on device
#    buffers; once with host staging (MPI_TP_CUDA_AWARE=0) and once letting MPI take device buffers
#    when the library says it can.
# 3. A short training run and a benchmark on the GPU.
# A GPU test run counts as passed only if its tests ran: a run where pytest skipped any of them (no
# CuPy, no GPU) or passed none is a failure, with pytest's skip reasons shown.
# Prints "N passed, N failed" at the end and exits non-zero if anything failed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MPIEXEC=${MPIEXEC:-mpiexec}
passed=0; failed=0
check() { echo "=== $1"; shift; if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "=== FAILED"; fi; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT
ran() {  # ran CMD...: run a pytest command (-rs); true only if it passed, skipped nothing and passed something
  "$@" -rs | tee "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || return 1
  if grep -Eq '[0-9]+ skipped' "$log"; then
    echo "gpu_check: FAILED: the GPU tests did not run ($(grep -Eo '[0-9]+ skipped' "$log" | head -1):" \
         "$(grep -o 'SKIPPED \[[0-9]*\] [^ ]*:[0-9]*: .*' "$log" | sed 's/^[^:]*:[0-9]*: //' | sort -u | paste -sd';'))"
    return 1
  fi
  grep -Eq '[1-9][0-9]* passed' "$log" || { echo "gpu_check: FAILED: no GPU test passed"; return 1; }
}

check "CuPy and a GPU" "$PY" -c "import cupy; n = cupy.cuda.runtime.getDeviceCount(); print(n, 'GPU(s):', cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()); assert n > 0"
check "MPI CUDA support" "$PY" -c "from mpi_tp.core.gpu import cuda_aware_mpi; print('CUDA-aware MPI:', cuda_aware_mpi())"
for n in 1 2 4; do
  check "GPU tests, $n rank(s), host staging" ran env MPI_TP_CUDA_AWARE=0 "$MPIEXEC" -n "$n" "$PY" -m mpi4py -m pytest -q -p no:cacheprovider --with-mpi tests/test_gpu.py
done
if "$PY" -c "from mpi_tp.core.gpu import cuda_aware_mpi; raise SystemExit(0 if cuda_aware_mpi() else 1)"; then
  check "GPU tests, 2 ranks, device buffers to MPI" ran "$MPIEXEC" -n 2 "$PY" -m mpi4py -m pytest -q -p no:cacheprovider --with-mpi tests/test_gpu.py
fi
out=$(mktemp -d)
check "training on the GPU, 2 ranks" "$MPIEXEC" -n 2 "$PY" -m mpi_tp train --backend cupy --steps 200 --out "$out/run" --sample-len 100
check "benchmark on the GPU, 1 rank" "$PY" -m mpi_tp bench --backend cupy --shape c --steps 10
rm -rf "$out"
echo "gpu_check: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
