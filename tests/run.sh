#!/usr/bin/env bash
# The whole test suite at world sizes 1, 2 and 4.
#
#   bash tests/run.sh              (from the repository root, with mpi_tp and the 'test' extra installed)
#
# Pass 1 runs every test in one process (kernels, data, CLI jobs that start their
# own mpiexec, and the MPI tests at world size 1). Passes 2 and 4 run the MPI tests
# (those marked @pytest.mark.mpi, selected with -m mpi) under mpiexec. Each pass must run at least one
# test and pass; a pass that hangs is killed after MPI_TP_PASS_TIMEOUT seconds.
# Extra arguments go to every pytest call (e.g. -k attention).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MPIEXEC=${MPIEXEC:-mpiexec}
TIMEOUT=${MPI_TP_PASS_TIMEOUT:-900}
# One BLAS thread per rank: 4 ranks on 2 cores are oversubscribed as it is.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
command -v "$MPIEXEC" >/dev/null || { echo "tests/run.sh: no '$MPIEXEC' on PATH (pip install mpich, or load your MPI module)"; exit 1; }

failed=()
pass() {  # pass NAME CMD...: run one pytest pass; pytest exit 5 (no tests ran) is a failure too
  local name=$1; shift
  echo "=== $name: $*"
  timeout --kill-after=10 "$TIMEOUT" "$@"
  local rc=$?
  case $rc in
    0) echo "=== $name: passed" ;;
    5) echo "=== $name: FAILED (no tests ran)"; failed+=("$name") ;;
    124|137) echo "=== $name: FAILED (timed out after ${TIMEOUT}s)"; failed+=("$name") ;;
    *) echo "=== $name: FAILED (exit $rc)"; failed+=("$name") ;;
  esac
}

PYTEST=(-m pytest -p no:cacheprovider -q --with-mpi tests "$@")
MPI_TP_EXPECT_WORLD=1 pass "world size 1" "$PY" "${PYTEST[@]}"
for n in 2 4; do
  MPI_TP_EXPECT_WORLD=$n pass "world size $n" "$MPIEXEC" -n "$n" "$PY" -m mpi4py "${PYTEST[@]}" -m mpi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "tests/run.sh: failed passes: ${failed[*]}"
  exit 1
fi
echo "tests/run.sh: all passes (world sizes 1, 2, 4) passed"
