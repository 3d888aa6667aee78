#!/usr/bin/env bash
# The GPU check in one command, on a machine with an NVIDIA GPU (mpi_tp installed with the gpu extra):
#
#   bash experiments/gpu/gpu_check.sh [--out DIR] [--only WORDS] [--budget SECONDS]
#
# Runs experiments/gpu/gpu_check.py (what it checks: its docstring); writes DIR/report.md and
# DIR/report.json; exits 1 if any check failed. Add --standin for a dry run without a GPU.
cd "$(dirname "$0")/../.." || exit 1
exec "${PYTHON:-python}" experiments/gpu/gpu_check.py "$@"
