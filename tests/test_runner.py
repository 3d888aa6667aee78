"""tests/run.sh's first pass spreads files over pytest-xdist workers; the suite runs without them too.

    python -m pytest -q tests/test_runner.py

- Without pytest-xdist (`-p no:xdist`, as on a machine that lacks it, or MPI_TP_TEST_WORKERS=1) the
  conftest loads and a file's tests run: it implements an xdist hook, which pytest refuses unless
  it is optional.
- A bad MPI_TP_TEST_WORKERS or MPI_TP_OTHER_WORLDS is one line and status 1, before any pass starts.
"""
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_tp.core.mpi_library import child_job_env

ROOT = Path(__file__).resolve().parent.parent
ENV = child_job_env()


def test_the_suite_runs_without_pytest_xdist():
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "--with-mpi",
                        "tests/test_layers.py", "-k", "column"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("name,value,said", [
    ("MPI_TP_TEST_WORKERS", "two", "give a number of workers (0 or 1: one process)"),
    ("MPI_TP_OTHER_WORLDS", "2 x", 'give world sizes ("2 3"; "" for none)')])
def test_a_bad_setting_is_one_line(name, value, said):
    r = subprocess.run(["bash", "tests/run.sh"], cwd=ROOT, env=dict(ENV, **{name: value}),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.strip().splitlines() == [f"tests/run.sh: {name}={value}: {said}"], r.stdout
