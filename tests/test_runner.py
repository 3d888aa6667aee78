"""tests/run.sh's first pass spreads files over pytest-xdist workers; the suite runs without them too.

    python -m pytest -q tests/test_runner.py

- Without pytest-xdist (`-p no:xdist`, as on a machine that lacks it, or MPI_TP_TEST_WORKERS=1) the
  conftest loads and a file's tests run: it implements an xdist hook, which pytest refuses unless
  it is optional.
- A bad MPI_TP_TEST_WORKERS is one line and status 1, before any pass starts.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_TP_EXPECT"))}


def test_the_suite_runs_without_pytest_xdist():
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "--with-mpi",
                        "tests/test_layers.py", "-k", "column"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_a_bad_worker_count_is_one_line():
    r = subprocess.run(["bash", "tests/run.sh"], cwd=ROOT, env=dict(ENV, MPI_TP_TEST_WORKERS="two"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.strip().splitlines() == [
        "tests/run.sh: MPI_TP_TEST_WORKERS=two: give a number of workers (0 or 1: one process)"], r.stdout
