#!/usr/bin/env bash
# The whole test suite at world sizes 1, 2, 3 and 4, and the GPU tests on the CuPy stand-in at 1 and 2.
#
#   bash tests/run.sh              (from the repository root, with mpi_tp and the 'test' extra installed)
#
# Pass 1 runs every test without mpiexec (kernels, data, CLI jobs that start their
# own mpiexec, and the MPI tests at world size 1), its files shared out among
# MPI_TP_TEST_WORKERS pytest-xdist workers (default: the cores, at most 4; 0 or 1, or no
# pytest-xdist: one process; each file's tests stay in one worker, so a file's fixtures and
# the folders they own are never shared; on the 2-core build machine 2 workers took 373 s where
# one took 478). Passes 2, 3 and 4 run the MPI tests
# (those marked @pytest.mark.mpi, selected with -m mpi) under mpiexec; 3 ranks split
# heads, vocabulary, MLP width (4C) and sequence unevenly, which 2 and 4 cannot do for 4C.
# Passes 5, 6 and 7 run the GPU tests (tests/test_gpu.py, skipped above without CuPy and a GPU) on
# the host stand-in for CuPy (MPI_TP_CUPY_STANDIN=1, mpi_tp/core/standin) at 1 and 2 ranks with MPI
# not CUDA-aware (every buffer staged through host buffers), and at 2 declared CUDA-aware (device
# buffers to MPI by pointer); the rest of the stand-in slice (tests/test_standin*.py) selects the
# stand-in itself and runs in passes 1 and 2. docs/clusters.md#without-a-gpu-the-cupy-stand-in.
# Then the other MPI (Open MPI when this environment's mpi4py runs on MPICH, MPICH when it runs on Open
# MPI), from a venv of its own that tests/other_mpi.sh makes on first use: the MPI tests at
# MPI_TP_OTHER_WORLDS ranks (default "2 3"; "" for none) and the tests that start jobs of their own
# (marked 'launcher': a pipelined training run, a crash that must end the job, SIGTERM to the ranks).
# MPI_TP_OTHER_MPI=none leaves them out (said in the skip lines); where the other MPI cannot be installed,
# they are skipped with the reason. Under Open MPI the launcher is told it may run as root (containers)
# and start more ranks than cores (docs/clusters.md#open-mpi).
# Each pass must run at least one test and pass; a pass that hangs is killed after
# MPI_TP_PASS_TIMEOUT seconds. At the end one line says whether every pass passed (exit 0)
# or which failed (exit 1), and the last lines count each pass's skipped tests by reason
# (pytest -rs; under mpiexec rank 0's, the conftest keeps the other ranks' out).
# Extra arguments go to every pytest call (e.g. -k attention).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MPIEXEC=${MPIEXEC:-mpiexec}
TIMEOUT=${MPI_TP_PASS_TIMEOUT:-1800}
# One BLAS thread per rank: 3 or 4 ranks on 2 cores are oversubscribed as it is.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
command -v "$MPIEXEC" >/dev/null || { echo "tests/run.sh: no '$MPIEXEC' on PATH (pip install mpich, or load your MPI module)"; exit 1; }
launcher_env() {  # launcher_env PYTHON: VAR=value words its MPI's mpiexec needs here (none for MPICH)
  "$1" -m mpi_tp.core.mpi_library --launcher-env
}
for setting in $(launcher_env "$PY"); do export "${setting?}"; done
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT

# (grep -a: pytest-mpi prints MPI_Get_library_version, which under Open MPI ends in a NUL byte)
skips() {  # skips LOG: "N (reason: n, ...)" from pytest's "SKIPPED [n] file:line: reason" lines in LOG
  local counts total said
  counts=$(grep -ao 'SKIPPED \[[0-9]*\] [^ ]*:[0-9]*: .*' "$1" |
    sed -E "s/^SKIPPED \[([0-9]+)\] [^ ]*:[0-9]+: /\1\t/; s/\tcould not import '([^']+)'.*/\t\1 not installed/
              s/\tTest requires ([0-9]+) MPI processes.*/\tneeds \1 MPI ranks/" |
    awk -F'\t' '{ n[$2] += $1 } END { for (r in n) printf "%d\t%s\n", n[r], r }' | sort -t"$(printf '\t')" -k1,1nr -k2)
  total=$(printf '%s\n' "$counts" | awk -F'\t' '{ t += $1 } END { print t + 0 }')
  printf '%d' "$total"
  [ "$total" -gt 0 ] && printf ' (%s)' "$(printf '%s\n' "$counts" | awk -F'\t' '{ printf "%s%s: %d", (NR > 1 ? ", " : ""), $2, $1 }')"
  # cross-check with pytest's closing line ("3 passed, 2 skipped in 1.2s"): a pass that died has none
  if ! grep -aEq '(passed|failed|skipped|error|errors|deselected|no tests ran).* in [0-9.]+s' "$1"; then
    printf '; pytest printed no closing line'
  else
    said=$(grep -aEo '[0-9]+ skipped.* in [0-9.]+s' "$1" | head -1 | grep -Eo '^[0-9]+')
    [ "${said:-0}" = "$total" ] || printf '; pytest says %s skipped' "${said:-0}"
  fi
  return 0
}

failed=() skipped=()
pass() {  # pass NAME CMD...: run one pytest pass; pytest exit 5 (no tests ran) is a failure too
  local name=$1; shift
  local log="$LOGS/$((${#skipped[@]} + 1)).log"
  echo "=== $name: $*"
  timeout --kill-after=10 "$TIMEOUT" "$@" | tee "$log"
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) echo "=== $name: passed" ;;
    5) echo "=== $name: FAILED (no tests ran)"; failed+=("$name") ;;
    124|137) echo "=== $name: FAILED (timed out after ${TIMEOUT}s)"; failed+=("$name") ;;
    *) echo "=== $name: FAILED (exit $rc)"; failed+=("$name") ;;
  esac
  skipped+=("skipped: $name: $(skips "$log")")
}

PYTEST=(-m pytest -p no:cacheprovider --color=no -q -rfEs --with-mpi tests "$@")
# (nproc obeys OMP_NUM_THREADS, set to 1 above: not here)
WORKERS=${MPI_TP_TEST_WORKERS:-$(n=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)
                                 echo $((n < 4 ? n : 4)))}
case $WORKERS in ''|*[!0-9]*) echo "tests/run.sh: MPI_TP_TEST_WORKERS=$WORKERS: give a number of workers (0 or 1: one process)"; exit 1 ;; esac
OTHER_WORLDS=${MPI_TP_OTHER_WORLDS-2 3}
for n in $OTHER_WORLDS; do
  case $n in ''|*[!0-9]*|0) echo "tests/run.sh: MPI_TP_OTHER_WORLDS=$OTHER_WORLDS: give world sizes (\"2 3\"; \"\" for none)"; exit 1 ;; esac
done
SPREAD=()
if [ "$WORKERS" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
  SPREAD=(-n "$WORKERS" --dist loadfile)
fi
MPI_TP_EXPECT_WORLD=1 pass "world size 1" "$PY" "${PYTEST[@]}" "${SPREAD[@]}"
for n in 2 3 4; do
  MPI_TP_EXPECT_WORLD=$n pass "world size $n" "$MPIEXEC" -n "$n" "$PY" -m mpi4py "${PYTEST[@]}" -m mpi
done
for run in "1 0 staged" "2 0 staged" "2 1 CUDA-aware"; do
  read -r n aware how <<< "$run"
  MPI_TP_CUPY_STANDIN=1 MPI_TP_CUDA_AWARE=$aware MPI_TP_EXPECT_WORLD=$n \
    pass "GPU tests on the CuPy stand-in, MPI $how, world size $n" \
    "$MPIEXEC" -n "$n" "$PY" -m mpi4py -m pytest -p no:cacheprovider --color=no -q -rfEs --with-mpi tests/test_gpu.py "$@"
done

if [ "${MPI_TP_OTHER_MPI:-}" = none ]; then
  skipped+=("skipped: the other MPI: MPI_TP_OTHER_MPI=none")
elif other=$(bash tests/other_mpi.sh "$PY" 2>"$LOGS/other"); then
  IFS=$'\t' read -r venv library <<< "$other"
  env=(env PATH="$venv/bin:$PATH" $(launcher_env "$venv/bin/python"))
  for n in $OTHER_WORLDS; do
    MPI_TP_EXPECT_WORLD=$n pass "world size $n under $library" \
      "${env[@]}" mpiexec -n "$n" "$venv/bin/python" -m mpi4py "${PYTEST[@]}" -m mpi
  done
  MPI_TP_EXPECT_WORLD=1 pass "jobs the tests launch, under $library" \
    "${env[@]}" "$venv/bin/python" -m pytest -p no:cacheprovider --color=no -q -rfEs tests -m launcher "$@"
else
  skipped+=("skipped: the other MPI: $(cat "$LOGS/other")")
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "tests/run.sh: failed passes: ${failed[*]}"
  status=1
else
  echo "tests/run.sh: all passes (world sizes 1, 2, 3, 4; the GPU tests on the stand-in; the other MPI) passed"
  status=0
fi
printf '%s\n' "${skipped[@]}"                # last: what did not run, and why
exit $status
